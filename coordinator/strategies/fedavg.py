"""FedAvg, server half: the sample-weighted average of full weights (one architecture)."""

from __future__ import annotations

from coordinator.strategies.base import register_strategy
from coordinator.strategies.weight_averaging import WeightAveragingStrategy
from protocol.algorithms.fedavg import FedAvgConfig

__all__ = ["FedAvgStrategy"]


@register_strategy("fedavg")
class FedAvgStrategy(WeightAveragingStrategy):
    """Sample-weighted average of full weights; requires one architecture across the fleet."""

    config: FedAvgConfig
