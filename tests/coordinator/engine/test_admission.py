"""The engine asks a strategy's ``admit`` only where the strategy declares admission rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.strategies import STRATEGIES, AgentInfo, Strategy
from coordinator.strategies.fedproto import FedProtoStrategy
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
