"""FedTGP, edge half: FedProto's (CE + lambda * MSE to the global prototype of the label,
class prototypes up); only the server differs, and the config's defaults (lambda 0.1,
prediction by nearest global prototype)."""

from __future__ import annotations

from edge_agent.algorithms.base import register_edge_algorithm
from edge_agent.algorithms.prototype_exchange import PrototypeExchangeEdge

__all__ = ["FedTGPEdge"]


@register_edge_algorithm("fedtgp")
class FedTGPEdge(PrototypeExchangeEdge):
    """FedProto's edge half under FedTGP's name and config."""
