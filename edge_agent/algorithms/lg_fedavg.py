"""LG-FedAvg, edge half: the head is the exchanged module; the extractor stays local.

The one loop trains the whole model on cross-entropy (HtFLlib's ``clientlg``); only the head's
state dict is received before training and uploaded after it. Every agent's head starts from
one seed fleet-wide, derived from the head's shape, so round 1 averages heads that started
alike whatever the extractors are.
"""

from __future__ import annotations

from torch import nn

from edge_agent.algorithms.base import SharedModule, register_edge_algorithm
from edge_agent.algorithms.weights import WeightExchangeEdge, shared_head
from protocol.algorithms.lg_fedavg import LGFedAvgConfig
from protocol.contract.arrays import Encoding

__all__ = ["LGFedAvgEdge"]


@register_edge_algorithm("lg_fedavg")
class LGFedAvgEdge(WeightExchangeEdge[LGFedAvgConfig]):
    """Receives and uploads the head (``get_classifier()``); trains the whole model."""

    def exchanged_module(self) -> nn.Module:
        """The head: the only module that travels."""
        return self.ctx.model.get_classifier()

    def weight_encoding(self) -> Encoding:
        """As the run configures (``weight_encoding``)."""
        return self.config.weight_encoding

    def shared_modules(self) -> dict[str, SharedModule]:
        """The head starts identical on every agent whose head has its shape; the extractor
        keeps its own initialisation."""
        return {"head": shared_head(self.exchanged_module(), self.name)}
