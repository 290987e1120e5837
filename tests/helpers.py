"""Small helpers shared by the test suites (importable as ``helpers`` under pytest)."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from coordinator.broker.embedded import free_port
from coordinator.strategies import AgentInfo
from protocol.contract.messages import Capabilities, InputSpec, Register

if TYPE_CHECKING:  # torch is imported where an edge test needs it, not by every suite
    import torch

    from edge_agent.algorithms import EdgeAlgorithm, EdgeContext
    from edge_agent.trainer import TensorData
    from models import Classifier

E = TypeVar("E", bound="EdgeAlgorithm[Any]")

__all__ = [
    "Inbox",
    "edge_algorithm",
    "edge_context",
    "failed_tasks",
    "fake_agent",
    "free_port",
    "unique_id",
    "wait_for",
]

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


def edge_context(
    model: Classifier,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    num_classes: int,
    test_size: int | None = None,
    seed: int = 0,
    builder: Callable[[], Classifier] | None = None,
    global_test: TensorData | None = None,
) -> EdgeContext:
    """A CPU device holding ``(x, y)`` for an edge algorithm's unit tests.

    The test split is the first ``test_size`` samples (all of them when None); the batch
    generator is seeded with ``seed``; ``builder`` rebuilds ``model``'s architecture for the
    algorithms that re-initialise it. The caller builds ``model`` itself, so that it draws
    from torch's global generator exactly where its test seeded it.
    """
    import torch

    from edge_agent.algorithms import EdgeContext
    from edge_agent.trainer import TensorData

    test = TensorData(x, y) if test_size is None else TensorData(x[:test_size], y[:test_size])
    return EdgeContext(
        model=model,
        train=TensorData(x, y),
        test=test,
        num_classes=num_classes,
        device=torch.device("cpu"),
        generator=torch.Generator().manual_seed(seed),
        global_test=global_test,
        model_builder=builder,
    )


def edge_algorithm(name: str, kind: type[E], ctx: EdgeContext) -> E:
    """The edge half registered as ``name`` on ``ctx``, checked to be a ``kind``."""
    from edge_agent.algorithms import create_edge_algorithm

    edge = create_edge_algorithm(name, ctx)
    assert isinstance(edge, kind)
    return edge


def failed_tasks(run_dir: Path) -> list[dict[str, str]]:
    """The ``failed`` map (device -> why) of every step of a run that had a failed task; a
    step can meet its quorum while an agent's task failed, so a finished run may have some."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [step["failed"] for line in lines if (step := json.loads(line))["failed"]]
