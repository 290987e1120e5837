"""FedProto, edge half: CE + lambda * MSE(feature, global prototype of its label); class
prototypes up (:class:`PrototypeExchangeEdge`)."""

from __future__ import annotations

from edge_agent.algorithms.base import register_edge_algorithm
from edge_agent.algorithms.prototype_exchange import PrototypeExchangeEdge

__all__ = ["FedProtoEdge"]


@register_edge_algorithm("fedproto")
class FedProtoEdge(PrototypeExchangeEdge):
    """CE + lambda * MSE(feature, global prototype of its label); uploads class prototypes."""
