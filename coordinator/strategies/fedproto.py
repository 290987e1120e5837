"""FedProto, server half: the per-class plain mean of the participants' prototypes."""

from __future__ import annotations

from coordinator.class_stats import mean_prototypes
from coordinator.strategies.base import AgentInfo, Step, register_strategy
from coordinator.strategies.prototype_exchange import PrototypeExchangeStrategy
from protocol.algorithms.fedproto import FedProtoConfig
from protocol.contract.messages import Reply
from protocol.contract.payloads import PrototypeSet

__all__ = ["FedProtoStrategy"]


@register_strategy("fedproto")
class FedProtoStrategy(PrototypeExchangeStrategy):
    """Per-class plain mean of the participants' prototypes."""

    config: FedProtoConfig
    stale_replies = "weighted"  # staleness weights in the per-class mean

    def fold_prototypes(
        self, step: Step, replies: list[tuple[AgentInfo, Reply]]
    ) -> dict[str, float]:
        """c^y <- mean of c_k^y over participants holding y (unweighted, as in FedProto), or
        the configured robust reduction over them); in buffered mode weighted by the replies'
        staleness weights."""
        sets = [(r.payloads["protos"], r) for _, r in replies]
        uploads = [(s, r) for s, r in sets if isinstance(s, PrototypeSet)]
        self.protos = mean_prototypes(
            self.protos,
            [s for s, _ in uploads],
            self.num_classes,
            self.config.proto_encoding,
            rule=self.robust,
            weights=[self.reply_weight(r) for _, r in uploads],
        )
        return {
            "classes_with_prototype": float(
                0 if self.protos is None else self.protos.class_ids.size
            )
        }
