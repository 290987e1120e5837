"""Early stopping: the training rounds end once the monitored accuracy's best round is
``run.patience`` rounds old, or once it reaches ``run.stop_target``; the algorithm's final
steps then run as after the last round. The monitor is ``run.monitored``: the agents'
validation accuracy where they hold a validation split, never a test metric unless the run
names one.

``run.rounds`` stays the cap. The decision depends on the closed rounds' step records alone, so
a restarted coordinator replays the stored records and reaches the same best round and the same
stop. The last training round's record carries a ``stop`` field: why the rounds ended (the
patience ran out, or the cap was reached) and the best round the rule saw.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from coordinator.accuracy import RoundValue, round_value, training_rounds
from coordinator.config import RunConfig
from coordinator.strategies import Step, Strategy

__all__ = ["EarlyStop", "StopDecision"]


@dataclass(frozen=True)
class StopDecision:
    """Why the training rounds ended after ``round``."""

    round: int
    # "patience": no improvement for that many rounds; "target": the monitor reached
    # run.stop_target; "rounds": the cap
    reason: str
    best: RoundValue | None

    def describe(self, cfg: RunConfig) -> str:
        """One line for the log."""
        best = (
            "no value"
            if self.best is None
            else (f"best {self.best.value:.4f} at round {self.best.round}")
        )
        monitor = cfg.monitored
        if self.reason == "rounds":
            return f"training ended at the cap, round {self.round}: {monitor} {best}"
        if self.reason == "target":
            return (
                f"early stop after round {self.round}: {monitor} reached the target "
                f"{cfg.stop_target:g} ({best})"
            )
        return (
            f"early stop after round {self.round}: {monitor} {best}, not bettered by more "
            f"than {cfg.min_delta:g} for {cfg.patience} rounds"
        )


class EarlyStop:
    """The stopping rule, fed each closed training round's record in order."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.monitor = cfg.monitored
        self.best: RoundValue | None = None
        self.decision: StopDecision | None = None

    @property
    def enabled(self) -> bool:
        """Whether ``run.patience`` or ``run.stop_target`` is set (neither: every planned round
        runs, no record changes)."""
        return self.cfg.patience > 0 or self.cfg.stop_target > 0

    def replay(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Fold the stored records of a resumed run in, oldest first."""
        for record in training_rounds(records):
            self.observe(dict(record))

    def observe(self, record: dict[str, Any]) -> None:
        """Fold in one closed step's record; on the round that ends the training, note the
        decision on the record (its ``stop`` field)."""
        if not self.enabled or self.decision is not None or not training_rounds([record]):
            return
        number = int(record["round"])
        value = round_value(record, self.monitor)
        if value is not None and (
            self.best is None or value > self.best.value + self.cfg.min_delta
        ):
            self.best = RoundValue(number, value)
        target, patience = self.cfg.stop_target, self.cfg.patience
        if target > 0 and value is not None and value >= target:
            self.decision = StopDecision(number, "target", self.best)
        elif patience > 0 and self.best is not None and number - self.best.round >= patience:
            self.decision = StopDecision(number, "patience", self.best)
        elif number >= self.cfg.rounds:
            self.decision = StopDecision(number, "rounds", self.best)
        if self.decision is not None:
            record["stop"] = _stop_field(self.decision, self.cfg)

    def cut(self, plan: list[Step], strategy: Strategy[Any]) -> list[Step]:
        """``plan`` without the training rounds after an early stop, the final steps numbered
        from the last round run (``plan`` itself when there is nothing to cut)."""
        if self.decision is None or self.decision.reason == "rounds":
            return plan
        last = next(
            (
                i
                for i, s in enumerate(plan)
                if s.phase == "train" and s.round == self.decision.round
            ),
            None,
        )
        if last is None or not any(s.phase == "train" for s in plan[last + 1 :]):
            return plan
        return plan[: last + 1] + strategy.final_steps(self.decision.round)


def _stop_field(decision: StopDecision, cfg: RunConfig) -> dict[str, Any]:
    return {
        "reason": decision.reason,
        "monitor": cfg.monitored,
        "patience": cfg.patience,
        "min_delta": cfg.min_delta,
        "target": cfg.stop_target,
        "best_round": None if decision.best is None else decision.best.round,
        "best": None if decision.best is None else decision.best.value,
    }
