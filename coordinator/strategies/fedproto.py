"""FedProto, server half: the per-class plain mean of the participants' prototypes."""

from __future__ import annotations

from coordinator.class_stats import mean_prototypes
from coordinator.strategies.base import AgentInfo, Step, register_strategy
from coordinator.strategies.prototype_exchange import PrototypeExchangeStrategy
from protocol.algorithms.fedproto import FedProtoConfig
from protocol.contract.messages import Reply
from protocol.contract.payloads import PrototypeSet
from protocol.errors import ValidationError

__all__ = ["FedProtoStrategy"]


@register_strategy("fedproto")
class FedProtoStrategy(PrototypeExchangeStrategy):
    """Per-class plain mean of the participants' prototypes."""

    config: FedProtoConfig
    stale_replies = "weighted"  # staleness weights in the per-class mean

    def check_upload(self, step: Step, agent: AgentInfo, reply: Reply) -> None:
        """The shared checks; weighting by count, each count is also 1..local_epochs x the
        agent's registered samples (a larger claim would take a class's whole weight)."""
        super().check_upload(step, agent, reply)
        if self.config.proto_weighting != "count":
            return
        protos = reply.payloads["protos"]  # a PrototypeSet: the shared checks said so
        if not isinstance(protos, PrototypeSet):
            return
        limit = max(1, self.config.local_epochs) * agent.num_samples
        bad = [int(n) for n in protos.counts.tolist() if not 1 <= n <= limit]
        if bad:
            raise ValidationError(
                "reply.payloads.protos.counts", f"1..{limit} (local_epochs x samples)", bad
            )

    def fold_prototypes(
        self, step: Step, replies: list[tuple[AgentInfo, Reply]]
    ) -> dict[str, float]:
        """c^y <- mean of c_k^y over participants holding y (unweighted, as in FedProto;
        weighted by their counts of y with ``proto_weighting = "count"``), or the configured
        robust reduction over them; in buffered mode weighted by the replies' staleness
        weights as well."""
        sets = [(r.payloads["protos"], r) for _, r in replies]
        uploads = [(s, r) for s, r in sets if isinstance(s, PrototypeSet)]
        self.protos = mean_prototypes(
            self.protos,
            [s for s, _ in uploads],
            self.num_classes,
            self.config.proto_encoding,
            rule=self.robust,
            weights=[self.reply_weight(r) for _, r in uploads],
            by_count=self.config.proto_weighting == "count",
        )
        return {
            "classes_with_prototype": float(
                0 if self.protos is None else self.protos.class_ids.size
            )
        }
