"""FedAvg, edge half: the global weights in, the trained full weights out."""

from __future__ import annotations

from edge_agent.algorithms.base import register_edge_algorithm
from edge_agent.algorithms.weights import WeightExchangeEdge
from protocol.algorithms.fedavg import FedAvgConfig
from protocol.contract.arrays import Encoding

__all__ = ["FedAvgEdge"]


@register_edge_algorithm("fedavg")
class FedAvgEdge(WeightExchangeEdge[FedAvgConfig]):
    """Loads the global weights, trains, uploads the full weights (homogeneous fleets); every
    agent of one architecture starts from the same weights, so round 1 averages alike nets."""

    def weight_encoding(self) -> Encoding:
        """As the run configures (``weight_encoding``)."""
        return self.config.weight_encoding
