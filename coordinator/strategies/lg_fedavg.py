"""LG-FedAvg, server half: the sample-weighted mean of the agents' heads.

The coordinator keeps one global head, sends it to every selected agent (and in ``final``) and
replaces it by the sample-weighted mean of the uploaded heads through FedAvg's own code
(:class:`SharedModuleStrategy`, :func:`coordinator.aggregation.weighted_mean`). Extractors never
travel, so agents of any architecture may join; the head alone must agree: its tensors are
checked against the global head, and in round 1 against the round's first valid upload.
"""

from __future__ import annotations

from coordinator.strategies.base import register_strategy
from coordinator.strategies.weight_averaging import SharedModuleStrategy
from protocol.algorithms.lg_fedavg import LGFedAvgConfig

__all__ = ["LGFedAvgStrategy"]


@register_strategy("lg_fedavg")
class LGFedAvgStrategy(SharedModuleStrategy):
    """One global head, averaged by sample count; extractors stay home.

    Any architecture and input may join: only the head is shared, and its classes were checked
    by the engine. Its feature dimension is not in the registration, so :meth:`validate` refuses
    a head of another shape at its first upload.
    """

    config: LGFedAvgConfig
