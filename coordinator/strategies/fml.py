"""FML, server half: FedAvg of the meme models; private models never leave the devices.

The coordinator keeps one global meme, sends it to each selected agent and replaces it by the
sample-weighted mean of the uploaded memes (:class:`SharedModuleStrategy`, FedAvg's own
aggregation through :func:`coordinator.aggregation.weighted_mean`). Private architectures may
differ; every agent builds the same meme, so they must feed it one input.
"""

from __future__ import annotations

from coordinator.strategies.base import AgentInfo, admit_one_input, register_strategy
from coordinator.strategies.lg_fedavg import SharedModuleStrategy
from protocol.algorithms.fml import SharedModelConfig

__all__ = ["FMLStrategy"]


@register_strategy("fml")
class FMLStrategy(SharedModuleStrategy):
    """One global meme, averaged by sample count."""

    config: SharedModelConfig

    def admit(self, agent: AgentInfo, fleet: list[AgentInfo]) -> None:
        """Any private architecture; one input spec, since every agent builds the same meme."""
        admit_one_input(agent, fleet, self.config.shared_model)
