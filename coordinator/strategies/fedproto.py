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

    def fold_prototypes(
        self, step: Step, replies: list[tuple[AgentInfo, Reply]]
    ) -> dict[str, float]:
        """c^y <- mean of c_k^y over participants holding y (unweighted, as in FedProto), or
        the configured robust reduction over them."""
        sets = [r.payloads["protos"] for _, r in replies]
        self.protos = mean_prototypes(
            self.protos,
            [s for s in sets if isinstance(s, PrototypeSet)],
            self.num_classes,
            self.config.proto_encoding,
            rule=self.robust,
        )
        return {
            "classes_with_prototype": float(
                0 if self.protos is None else self.protos.class_ids.size
            )
        }
