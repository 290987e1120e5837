"""FedKD, server half: FedAvg of the mentees, as FML averages its memes, over SVD-compressed
uploads and downloads (the paper's §3.3, ``protocol.contract.lowrank``).

Only the shared mentee travels; the coordinator refuses an agent whose input differs from the
fleet's (:class:`SharedModelStrategy`). Each upload's factors are checked and multiplied out
before it is validated and averaged by sample count (HtFLlib's uniformly:
``sample_weighted = false``); the global mentee is kept whole and compressed once per round
for the tasks, at the energy of the round that produced it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from coordinator.strategies.base import AgentInfo, Step, register_strategy
from coordinator.strategies.weight_averaging import SharedModelStrategy
from protocol.algorithms.fedkd import FedKDConfig
from protocol.contract.lowrank import compress, is_compressed, restore
from protocol.contract.messages import Reply
from protocol.contract.payloads import Payload, TensorMap

__all__ = ["FedKDStrategy"]


def restored(reply: Reply) -> Reply:
    """``reply`` with its ``weights`` factors multiplied out (checked: peer input)."""
    w = reply.payloads.get("weights")
    if not isinstance(w, TensorMap) or not is_compressed(w):
        return reply
    whole = restore(w, "reply.payloads.weights")
    return replace(reply, payloads={**reply.payloads, "weights": whole})


@register_strategy("fedkd")
class FedKDStrategy(SharedModelStrategy):
    """One global mentee, averaged by sample count, compressed on the wire."""

    config: FedKDConfig

    def __init__(self, config: Any, *, num_classes: int, seed: int = 0) -> None:
        super().__init__(config, num_classes=num_classes, seed=seed)
        self._down: tuple[int, int, TensorMap] | None = None  # (round, id(weights), factors)

    def plan(self, rounds: int) -> list[Step]:
        """The energy ramps over the run's rounds unless the config names its own span."""
        if self.config.svd_rounds == 0:
            self.config = self.config.replace(svd_rounds=rounds)
        return super().plan(rounds)

    def send_weights(self, step: Step, agent: AgentInfo) -> dict[str, Payload]:
        """The global mentee, compressed at the energy of the round that made it (once)."""
        payloads = super().send_weights(step, agent)
        w = payloads.get("weights")
        if not self.config.svd or not isinstance(w, TensorMap):
            return payloads
        if self._down is None or self._down[:2] != (step.round, id(w)):
            energy = self.config.svd_energy(max(step.round - 1, 1))
            self._down = (step.round, id(w), compress(w, energy))
        return {**payloads, "weights": self._down[2]}

    def check_weights(self, step: Step, agent: AgentInfo, reply: Reply) -> None:
        """The upload's factors, then FML's checks of the whole mentee."""
        super().check_weights(step, agent, restored(reply))

    def average_weights(
        self, step: Step, replies: list[tuple[AgentInfo, Reply]]
    ) -> dict[str, float]:
        """FML's average of the whole mentees."""
        return super().average_weights(step, [(a, restored(r)) for a, r in replies])
