"""The engine asks a strategy's ``admit`` only where the strategy declares admission rules."""

from __future__ import annotations

from coordinator.strategies import STRATEGIES, Strategy


def test_every_strategy_with_its_own_admit_declares_admission_rules() -> None:
    # an admit the strategy does not declare is never called: its agents would all be admitted
    undeclared = [
        name
        for name, cls in STRATEGIES.items()
        if cls.admit is not Strategy.admit and not cls.admission_rules
    ]
    assert undeclared == []

