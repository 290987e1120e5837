"""FedKD, server half: FedAvg of the mentees, as FML averages its memes.

Only the shared mentee travels; the coordinator averages it by sample count and refuses an
agent whose input differs from the fleet's (:class:`FMLStrategy`). The paper's SVD compression
of the exchanged mentee is not built (docs/baselines.md).
"""

from __future__ import annotations

from coordinator.strategies.base import register_strategy
from coordinator.strategies.fml import FMLStrategy
from protocol.algorithms.fedkd import FedKDConfig

__all__ = ["FedKDStrategy"]


@register_strategy("fedkd")
class FedKDStrategy(FMLStrategy):
    """One global mentee, averaged by sample count."""

    config: FedKDConfig
