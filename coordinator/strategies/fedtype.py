"""FedType, server half (``shared/specs/fedtype.md`` §3.4): FedAvg of the proxies.

The server never sees a private model: it keeps one global proxy, sends it to each selected
agent and replaces it by the sample-weighted mean of the uploaded proxies through FedAvg's own
code (:class:`WeightAveragingStrategy` and :func:`coordinator.aggregation.weighted_mean`; integer
buffers such as ``num_batches_tracked`` take the maximum). FedProx changes only the devices'
proxy loss, so the server step is the same for both.

Private architectures differ by design, so admission checks only what fixes the proxy's
architecture: the input every agent feeds it (the proxy itself is named in the run's config).
"""

from __future__ import annotations

from typing import cast

from coordinator.strategies.base import AgentInfo, Step, admit_one_input, register_strategy
from coordinator.strategies.weight_averaging import WeightAveragingStrategy
from protocol.algorithms.fedtype import FedTypeConfig
from protocol.contract.messages import Reply
from protocol.contract.payloads import TensorMap
from protocol.errors import ValidationError

__all__ = ["FedTypeStrategy"]


@register_strategy("fedtype")
class FedTypeStrategy(WeightAveragingStrategy):
    """One global proxy, averaged by sample count (or uniformly); private models stay home."""

    one_architecture = False  # only the proxy is averaged

    def __init__(self, config: FedTypeConfig, *, num_classes: int, seed: int = 0) -> None:
        super().__init__(config, num_classes=num_classes, seed=seed)
        # round 1 has no global proxy yet: its uploads must agree with the first one validated
        self._layout: tuple[Step, dict[str, tuple[int, ...]]] | None = None

    @property
    def fedtype(self) -> FedTypeConfig:
        """The config with FedType's own fields."""
        return cast(FedTypeConfig, self.config)

    def admit(self, agent: AgentInfo, fleet: list[AgentInfo]) -> None:
        """Any private architecture; one input spec, since every agent builds the same proxy."""
        admit_one_input(agent, fleet, f"proxy ({self.fedtype.proxy_model})")

    def check_weights(self, step: Step, agent: AgentInfo, reply: Reply) -> None:
        """The proxy's tensors: those of the global proxy, or in round 1 those of the round's
        first valid upload (values are finite by the payload's own decoding)."""
        super().check_weights(step, agent, reply)
        if self.weights is not None:
            return
        upload = self.payload(reply, "weights", TensorMap)
        layout = {k: tuple(v.shape) for k, v in upload.tensors.items()}
        if self._layout is None or self._layout[0] != step:
            self._layout = (step, layout)
            return
        expected = self._layout[1]
        if layout != expected:
            diff = sorted(set(layout.items()) ^ set(expected.items()))[:3]
            raise ValidationError(
                "reply.payloads.weights", "the proxy tensors of this round's uploads", diff
            )

    def average_weights(
        self, step: Step, replies: list[tuple[AgentInfo, Reply]]
    ) -> dict[str, float]:
        """p_g = sum_i n_i p_i / sum n (§3.4); ``aggregation_weights = uniform``: plain mean."""
        if self.fedtype.aggregation_weights == "samples":
            return super().average_weights(step, replies)
        maps = [self.payload(r, "weights", TensorMap) for _, r in replies]
        self.weights = self.average(maps, None, self.config.weight_encoding, "fedtype proxies")
        return {"aggregated": float(len(replies))}
