"""The engine asks a strategy's ``admit`` only where the strategy declares admission rules;
new devices are bounded in number and rate."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.engine.admission import NewDevices
from coordinator.strategies import STRATEGIES, AgentInfo, Strategy
from coordinator.strategies.fedproto import FedProtoStrategy
from protocol.errors import ConfigError
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
