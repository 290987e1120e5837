"""FML, server half: FedAvg of the meme models; private models never leave the devices.

The coordinator keeps one global meme, sends it to each selected agent and replaces it by the
sample-weighted (or, with ``sample_weighted = false``, uniform) mean of the uploaded memes
(:class:`SharedModelStrategy`, FedAvg's own aggregation through
:func:`coordinator.aggregation.weighted_mean`). Private architectures may differ; every agent
builds the same meme, so they must feed it one input.
"""

from __future__ import annotations

from coordinator.strategies.base import register_strategy
from coordinator.strategies.weight_averaging import SharedModelStrategy
from protocol.algorithms.fml import FMLConfig

__all__ = ["FMLStrategy"]


@register_strategy("fml")
class FMLStrategy(SharedModelStrategy):
    """One global meme, averaged by sample count."""

    config: FMLConfig
