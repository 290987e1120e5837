"""FedGH, edge half: plain cross-entropy training; the global head arrives as ``weights`` and
replaces the classifier before training; class prototypes go up."""

from __future__ import annotations

from torch import nn

from edge_agent.algorithms.base import SharedModule, register_edge_algorithm
from edge_agent.algorithms.weights import WeightExchangeEdge, shared_head
from edge_agent.class_stats import class_feature_sums
from protocol.algorithms.fedgh import FedGHConfig
from protocol.contract.payloads import Payload

__all__ = ["FedGHEdge"]


@register_edge_algorithm("fedgh")
class FedGHEdge(WeightExchangeEdge[FedGHConfig]):
    """Receives the head (receive only), uploads prototypes."""

    def exchanged_module(self) -> nn.Module:
        """The classifier: the global head overwrites it."""
        return self.ctx.model.get_classifier()

    def shared_modules(self) -> dict[str, SharedModule]:
        """``shared_head``: the head from the seed the server's first head has too; else none
        (the extractors are the agents' own, the head comes from the server)."""
        if not self.config.shared_head:
            return {}
        return {"head": shared_head(self.exchanged_module(), self.name)}

    def reply_payloads(self) -> dict[str, Payload]:
        """Class prototypes of the trained model over the local training set."""
        model, train = self.ctx.model, self.ctx.train
        sums = class_feature_sums(model, train, self.ctx.num_classes, clip=self.dp_clip())
        self.release([sums], 1)
        return {"protos": sums.prototypes(self.config.proto_encoding)}
