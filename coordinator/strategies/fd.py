"""FD / FedDistill, server half: per-class means of the uploaded mean logits.

Every participant uploads its per-class mean logits as a :class:`PrototypeSet` whose vectors
have one entry per class of the federation. The global logit of a class is the plain mean over
the participants that uploaded it (HtFLlib's ``logit_aggregation``: unweighted, this round's
uploads only); ``carry_absent`` keeps the last global logit of a class nobody held this round.
Architectures may differ freely: only logits travel.
"""

from __future__ import annotations

from coordinator.class_stats import mean_prototypes
from coordinator.strategies.base import AgentInfo, PhaseHooks, Step, Strategy, register_strategy
from protocol.algorithms.fd import FDConfig
from protocol.contract.messages import Reply
from protocol.contract.payloads import Payload, PrototypeSet
from protocol.errors import ValidationError

__all__ = ["FDStrategy"]


@register_strategy("fd")
class FDStrategy(Strategy[FDConfig]):
    """Global per-class logits, the plain mean over the holders of each class."""

    stale_replies = "weighted"  # staleness weights in the per-class mean of the logits
    needs_class_counts = True  # each logit's count is bounded by the class's registered samples

    def __init__(self, config: FDConfig, *, num_classes: int, seed: int = 0) -> None:
        super().__init__(config, num_classes=num_classes, seed=seed)
        self.logits: PrototypeSet | None = None

    def phase_hooks(self) -> dict[str, PhaseHooks]:
        """Training rounds only: ``final`` carries nothing."""
        return {"train": PhaseHooks(self.send_logits, self.check_logits, self.mean_logits)}

    def send_logits(self, step: Step, agent: AgentInfo) -> dict[str, Payload]:
        """The global logits of every class that has one (none before the first round)."""
        if self.logits is None or not self.logits.class_ids.size:
            return {}
        return {"logits": self.logits}

    def check_logits(self, step: Step, agent: AgentInfo, reply: Reply) -> None:
        """Logits of the agent's own classes, one per class of the federation, each the mean of
        1..local_epochs x the agent's registered samples of that class."""
        logits = self.check_prototypes(agent, reply, "logits", self.num_classes)
        held = agent.register.counts_by_class()
        limit = max(1, self.config.local_epochs)
        ids, counts = logits.class_ids.tolist(), logits.counts.tolist()
        bad = [c for c, n in zip(ids, counts, strict=True) if n < 1 or n > limit * held.get(c, 0)]
        if bad:
            raise ValidationError(
                "reply.payloads.logits.counts",
                "1..local_epochs x the registered samples of each class",
                bad,
            )

    def mean_logits(self, step: Step, replies: list[tuple[AgentInfo, Reply]]) -> dict[str, float]:
        """z_c <- mean of the uploaded z_c^k over the uploaders of class c (in buffered mode
        weighted by the replies' staleness weights)."""
        uploads = [
            (s, r) for _, r in replies if isinstance(s := r.payloads.get("logits"), PrototypeSet)
        ]
        current = self.logits if self.config.carry_absent else None
        self.logits = mean_prototypes(
            current,
            [s for s, _ in uploads],
            self.num_classes,
            self.config.logit_encoding,
            rule=self.robust,
            weights=[self.reply_weight(r) for _, r in uploads],
        )
        held = 0 if self.logits is None else int(self.logits.class_ids.size)
        return {"classes_with_logits": float(held)}

    def state_dict(self) -> dict[str, Payload]:
        """The global logits."""
        return {} if self.logits is None else {"logits": self.logits}

    def load_state_dict(self, state: dict[str, Payload]) -> None:
        """Restore the global logits."""
        logits = state.get("logits")
        self.logits = logits if isinstance(logits, PrototypeSet) else None
