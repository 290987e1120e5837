"""A task in flight longer than a step's deadline goes out again when a step opens (its reply
may have been lost); one sent within the deadline does not."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from coordinator.engine.buffered import TaskBuffer
from coordinator.engine.staleness import StalenessRule
from coordinator.engine.step import OpenStep
from coordinator.store.database import StepRecord
from coordinator.strategies import Step
from protocol.contract.messages import Task


class MetaStore:
    """The store's meta table, in memory."""

    def __init__(self) -> None:
        self.meta: dict[str, Any] = {}

    def get_meta(self, key: str) -> Any:
        return self.meta.get(key)

    def set_meta(self, key: str, value: Any) -> None:
        self.meta[key] = value


def task(device: str, round_: int) -> Task:
    return Task(
        task_id=f"r.{round_}.0.{device}",
        run_id="r",
        round=round_,
        phase="train",
        deadline=0.0,
        algorithm="fedavg",
    )


def open_step(round_: int, devices: list[str]) -> OpenStep:
    rec = StepRecord(round_ - 1, round_, "train", devices, "open", 0)
    return OpenStep(rec, Step(round_, "train"))


def test_a_task_in_flight_past_the_deadline_is_sent_again_once_per_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    rule = StalenessRule("polynomial", 0.5, 4.0, 10)
    buf = TaskBuffer(rule, 2, MetaStore(), resend_after_s=30.0)  # type: ignore[arg-type]
    collector: Any = SimpleNamespace(deferred_from=set())
    # round 1 closes with a0's task still in flight (its reply lost, say)
    first = open_step(1, ["a0", "a1"])
    first.sent("a0", task("a0", 1))
    buf.close(first)

    def opened(round_: int) -> dict[str, Task]:
        again, _restored = buf.open(open_step(round_, ["a0", "a1"]), collector)
        return again

    assert opened(2) == {}  # first seen now: within the deadline
    clock[0] += 20.0
    assert opened(3) == {}
    clock[0] += 15.0  # 35 s in flight > 30 s
    again = opened(4)
    assert list(again) == ["a0"] and again["a0"].task_id == "r.1.0.a0"  # the same task
    clock[0] += 10.0  # sent again 10 s ago: not yet again
    assert opened(5) == {}


def test_a_synchronous_or_default_buffer_never_resends_on_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    buf = TaskBuffer(StalenessRule("constant", 0.5, 4.0, 10), 2, MetaStore())  # type: ignore[arg-type]
    first = open_step(1, ["a0"])
    first.sent("a0", task("a0", 1))
    buf.close(first)
    collector: Any = SimpleNamespace(deferred_from=set())
    buf.open(open_step(2, ["a0"]), collector)
    clock[0] += 1e9
    again, _ = buf.open(open_step(3, ["a0"]), collector)
    assert again == {}
