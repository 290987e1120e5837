"""Small helpers shared by the test suites (importable as ``helpers`` under pytest)."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable

from coordinator.strategies import AgentInfo
from protocol.broker import free_port
from protocol.messages import Capabilities, InputSpec, Register

__all__ = ["Inbox", "fake_agent", "free_port", "unique_id", "wait_for"]

_counter = itertools.count()


def unique_id(prefix: str = "t") -> str:
    """An id unique within this test session, usable as a topic level or client id."""
    return f"{prefix}-{os.getpid()}-{next(_counter)}"


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.005) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass; returns its last value.

    A generous timeout is a bound on a hang, not a performance assertion.
    """
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


class Inbox:
    """Thread-safe collector for transport or endpoint callbacks."""

    def __init__(self) -> None:
        self.items: list[tuple[object, ...]] = []
        self._lock = threading.Lock()

    def __call__(self, *args: object) -> None:
        with self._lock:
            self.items.append(args)

    def __len__(self) -> int:
        with self._lock:
            return len(self.items)

    def wait(self, count: int = 1, timeout: float = 10.0) -> bool:
        """Wait until at least ``count`` items arrived."""
        return wait_for(lambda: len(self) >= count, timeout)


def fake_agent(
    device_id: str,
    algorithm: str,
    counts: dict[int, int],
    *,
    num_classes: int = 4,
    arch: str = "cnn_t1",
    num_params: int = 10,
    input_spec: tuple[int, int, int] = (1, 8, 8),
) -> AgentInfo:
    """A registered agent for strategy unit tests, ``counts`` samples per class."""
    reg = Register(
        device_id=device_id,
        arch=arch,
        num_params=num_params,
        capabilities=Capabilities(device="cpu"),
        input_spec=InputSpec(*input_spec),
        num_classes=num_classes,
        class_counts={str(c): n for c, n in counts.items()},
        algorithm=algorithm,
    )
    return AgentInfo(device_id, reg)
