"""Local-only training, edge half: the plain loop, nothing exchanged."""

from __future__ import annotations

from edge_agent.algorithms.base import EdgeAlgorithm, register_edge_algorithm
from protocol.algorithms.local import LocalConfig

__all__ = ["LocalEdge"]


@register_edge_algorithm("local")
class LocalEdge(EdgeAlgorithm[LocalConfig]):
    """Trains on local data only and uploads nothing: the baseline every method must beat."""
