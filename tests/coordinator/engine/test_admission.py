"""The engine asks a strategy's ``admit`` only where the strategy declares admission rules;
new devices are bounded in number and rate."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from coordinator.engine.admission import NewDevices
from coordinator.engine.step import OpenStep
from coordinator.ops.revocation import RevocationWatch, write_revoked
from coordinator.store.database import StepRecord
from coordinator.strategies import STRATEGIES, AgentInfo, Step, Strategy
from coordinator.strategies.fedproto import FedProtoStrategy
from protocol.contract.messages import Reply, Task
from protocol.errors import AdmissionError, ConfigError
from protocol.transport.base import MemoryBroker
from tests.helpers import fake_agent
from tests.helpers_runtime import run_config, start_coordinator


def test_every_strategy_with_its_own_admit_declares_admission_rules() -> None:
    # an admit the strategy does not declare is never called: its agents would all be admitted
    undeclared = [
        name
        for name, cls in STRATEGIES.items()
        if cls.admit is not Strategy.admit and not cls.admission_rules
    ]
    assert undeclared == []


def test_admit_is_asked_with_the_fleet_only_when_rules_are_declared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a fedproto run (no rules of its own) whose admit records what it is asked
    asked: list[tuple[str, list[str]]] = []

    def admit(self: Strategy[object], agent: AgentInfo, fleet: list[AgentInfo]) -> None:
        asked.append((agent.device_id, [a.device_id for a in fleet]))

    monkeypatch.setattr(FedProtoStrategy, "admit", admit)
    coord = start_coordinator(run_config(tmp_path), MemoryBroker())
    num_classes = coord.cfg.num_classes
    coord.agents["a"] = fake_agent("a", "fedproto", {0: 5}, num_classes=num_classes)
    # Execute
    coord.admission.check(fake_agent("b", "fedproto", {0: 5}, num_classes=num_classes))
    monkeypatch.setattr(FedProtoStrategy, "admission_rules", True)
    coord.admission.check(fake_agent("c", "fedproto", {0: 5}, num_classes=num_classes))
    # Assert
    assert asked == [("c", ["a"])]


def test_new_devices_refill_at_the_rate_and_the_awaited_fleet_comes_at_once() -> None:
    now = [0.0]
    bucket = NewDevices(per_min=60, burst=100, clock=lambda: now[0])  # min_agents 100
    for _ in range(100):
        assert bucket.available()
        bucket.take()
    assert not bucket.available()
    now[0] = 1.0  # a second: one more device
    assert bucket.available()
    bucket.take()
    assert not bucket.available()
    unbounded = NewDevices(per_min=0, burst=2, clock=lambda: now[0])
    for _ in range(1000):
        assert unbounded.available()
        unbounded.take()


def test_limits_below_the_awaited_fleet_are_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_agents >= min_agents"):
        run_config(tmp_path, min_agents=3, max_agents=2)
    with pytest.raises(ConfigError, match="max_registrations_per_min >= 0"):
        run_config(tmp_path, max_registrations_per_min=-1)


def test_a_revoked_device_leaves_the_open_step_and_is_refused_after(tmp_path: Path) -> None:
    # Prepare: a coordinator watching a revocation list; a step open for a and b, b replied
    listed = tmp_path / "revoked"
    coord = start_coordinator(run_config(tmp_path), MemoryBroker())
    admission = coord.admission
    admission.revocations = RevocationWatch(listed, logging.getLogger("test"), poll_s=0)
    num_classes = coord.cfg.num_classes
    for device in ("a", "b"):
        coord.agents[device] = fake_agent(device, "fedproto", {0: 5}, num_classes=num_classes)
        coord.presence.registered(device)
    rec = StepRecord(0, 1, "train", ["a", "b"], "open", 0)
    open_step = OpenStep(rec, Step(1, "train"))
    for device in ("a", "b"):
        task = Task(f"t-{device}", "t", 1, "train", deadline=0.0, algorithm="fedproto")
        open_step.sent(device, task)
    open_step.replied("b", Reply(task_id="t-b", round=1, phase="train", num_samples=5))
    # Execute: b is revoked (after a first look at the list, which names nobody)
    admission.poll_revocations(open_step)
    write_revoked(listed, ["b"])
    admission.poll_revocations(open_step)
    # Assert: b is gone from the step (its reply not counted), not selectable, refused
    assert open_step.gone == {"b"} and open_step.outstanding == {"a"}
    assert "b" not in open_step.outcome.replies and open_step.task_of("b") is None
    assert admission.online_agents() == ["a"]
    with pytest.raises(AdmissionError, match="revoked"):
        admission.check(fake_agent("b", "fedproto", {0: 5}, num_classes=num_classes))
