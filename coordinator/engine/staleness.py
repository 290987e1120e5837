"""Staleness weights of buffered (semi-asynchronous) aggregation.

In ``run.mode = "buffered"`` a reply may answer a task sent from an older global version. Its
staleness ``s`` is the number of global updates since that task's version (the open round minus
the task's round); its aggregation weight (the strategy's usual one, e.g. its sample count) is
multiplied by ``weight(s)``:

- ``constant``: ``1``
- ``polynomial``: ``(1 + s) ** -a``
- ``hinge``: ``1`` if ``s <= b``, else ``1 / (a * (s - b) + 1)``

(Xie et al., *Asynchronous Federated Optimization*, 2019; FedBuff, Nguyen et al. 2022, uses the
polynomial with ``a = 0.5``.) A reply with ``s > run.max_staleness`` is refused as ``stale``.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import ConfigError

__all__ = ["STALENESS_FUNCTIONS", "StalenessRule"]

STALENESS_FUNCTIONS = ("constant", "polynomial", "hinge")


@dataclass(frozen=True)
class StalenessRule:
    """``weight(s)`` of one of :data:`STALENESS_FUNCTIONS`, and the bound on ``s``."""

    function: str = "polynomial"
    a: float = 0.5
    b: float = 4.0
    max_staleness: int = 10

    def __post_init__(self) -> None:
        if self.function not in STALENESS_FUNCTIONS:
            raise ConfigError(
                f"run.staleness: expected one of {', '.join(STALENESS_FUNCTIONS)}, "
                f"got {self.function!r}"
            )
        if self.a < 0 or self.b < 0 or self.max_staleness < 0:
            raise ConfigError(
                "run: staleness_a >= 0, staleness_b >= 0, max_staleness >= 0; got "
                f"{self.a}, {self.b}, {self.max_staleness}"
            )

    def weight(self, s: int) -> float:
        """The factor on the aggregation weight of a reply ``s`` global versions old."""
        if s < 0:
            raise ValueError(f"staleness must be >= 0, got {s}")
        if self.function == "polynomial":
            return float((1.0 + s) ** -self.a)
        if self.function == "hinge":
            return 1.0 if s <= self.b else 1.0 / (self.a * (s - self.b) + 1.0)
        return 1.0

    def refusal(self, s: int, task_round: int, now: int) -> str | None:
        """Why a reply ``s`` versions old is refused (``None``: it is folded in)."""
        if s <= self.max_staleness:
            return None
        return (
            f"stale: the task was of round {task_round}, the run is at round {now} "
            f"(staleness {s} > run.max_staleness {self.max_staleness})"
        )
