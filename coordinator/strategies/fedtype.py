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

__all__ = ["FedTypeStrategy"]


@register_strategy("fedtype")
class FedTypeStrategy(WeightAveragingStrategy):
    """One global proxy, averaged by sample count (or uniformly); private models stay home."""

    one_architecture = False  # only the proxy is averaged

    @property
    def fedtype(self) -> FedTypeConfig:
        """The config with FedType's own fields."""
        return cast(FedTypeConfig, self.config)

    def admit(self, agent: AgentInfo, fleet: list[AgentInfo]) -> None:
        """Any private architecture; one input spec, since every agent builds the same proxy."""
        admit_one_input(agent, fleet, f"proxy ({self.fedtype.proxy_model})")

    def average_weights(
        self, step: Step, replies: list[tuple[AgentInfo, Reply]]
    ) -> dict[str, float]:
        """p_g = sum_i n_i p_i / sum n (§3.4); ``aggregation_weights = uniform``: plain mean."""
        if self.fedtype.aggregation_weights == "samples":
            return super().average_weights(step, replies)
        replies, outliers = self.agreeing(replies)
        maps = [self.payload(r, "weights", TensorMap) for _, r in replies]
        self.weights = self.average(maps, None, self.config.weight_encoding, "fedtype proxies")
        return {"aggregated": float(len(replies)), **outliers}
