"""FML, server half: FedAvg of the meme models; private models never leave the devices.

The coordinator keeps one global meme, sends it to each selected agent and replaces it by the
sample-weighted mean of the uploaded memes (:class:`SharedModuleStrategy`, FedAvg's own
aggregation through :func:`coordinator.aggregation.weighted_mean`). Private architectures may
differ; every agent builds the same meme, so they must feed it one input.
"""

from __future__ import annotations

from coordinator.strategies.base import AgentInfo, register_strategy
from coordinator.strategies.lg_fedavg import SharedModuleStrategy
from protocol.algorithms.fml import SharedModelConfig
from protocol.errors import AdmissionError

__all__ = ["FMLStrategy", "admit_one_input"]


def admit_one_input(agent: AgentInfo, fleet: list[AgentInfo], shared_model: str) -> None:
    """Refuse an agent whose input differs from the fleet's: the shared model takes one input."""
    others = [a.register for a in fleet if a.device_id != agent.device_id]
    mine = agent.register.input_spec
    if others and mine != others[0].input_spec:
        theirs = others[0].input_spec
        raise AdmissionError(
            agent.device_id,
            f"the fleet shares one {shared_model} built for input "
            f"{theirs.channels}x{theirs.height}x{theirs.width}; this agent feeds "
            f"{mine.channels}x{mine.height}x{mine.width}",
        )


@register_strategy("fml")
class FMLStrategy(SharedModuleStrategy):
    """One global meme, averaged by sample count."""

    config: SharedModelConfig

    def admit(self, agent: AgentInfo, fleet: list[AgentInfo]) -> None:
        """Any private architecture; one input spec, since every agent builds the same meme."""
        admit_one_input(agent, fleet, self.config.shared_model)
