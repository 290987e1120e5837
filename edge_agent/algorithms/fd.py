"""FD / FedDistill, edge half: distil towards the global logit of each sample's class.

A participation: take the global per-class logits, train with the one loop on
``CE + kd_weight * fd_kd_loss``, masked to samples whose class has a global logit, while summing
the logits of the training forward passes per class (``after_step``, no second pass), and
upload their per-class means.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from edge_agent.algorithms.base import (
    EdgeAlgorithm,
    EdgeContext,
    PhaseResult,
    TaskPayloads,
    received,
    register_edge_algorithm,
    task_payloads,
)
from edge_agent.class_stats import ClassMeans, prototype_table
from protocol.algorithms.fd import FDConfig
from protocol.contract.messages import Task
from protocol.contract.payloads import Payload, PrototypeSet
from protocol.errors import ValidationError

__all__ = ["FDEdge", "fd_kd_loss"]


def fd_kd_loss(logits: Tensor, targets: Tensor, mask: Tensor, kind: str = "mse") -> Tensor:
    """The distillation term over a batch; rows with ``mask`` false contribute zero.

    ``mse``: squared logit error summed over masked rows, divided by all ``B x C`` elements
    (HtFLlib's ``MSELoss`` over a batch whose unmasked rows are their own target).
    ``soft_ce``: ``-sum_c softmax(target)_c log softmax(logit)_c`` per masked row, divided by
    ``B`` (the gradient of HtFLlib's ``clientfd``; its unmasked rows add a constant only).
    """
    z, m = logits.float(), mask.float().unsqueeze(1)
    if kind == "mse":
        return ((z - targets).pow(2) * m).sum() / z.numel()
    soft = -(F.softmax(targets, dim=1) * F.log_softmax(z, dim=1)) * m
    return soft.sum() / len(z)


@register_edge_algorithm("fd")
class FDEdge(EdgeAlgorithm[FDConfig]):
    """Global logits in, per-class mean logits of the training passes out."""

    TASK_PAYLOADS: ClassVar[TaskPayloads] = task_payloads({"logits": PrototypeSet})

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        c, dev = ctx.num_classes, ctx.device
        self.table = torch.zeros(c, c, device=dev)  # row y: the global logit of class y
        self.valid = torch.zeros(c, dtype=torch.bool, device=dev)
        self._logits = ClassMeans(c, c, dev)  # this participation's training logits

    def receive(self, payloads: dict[str, Payload]) -> None:
        """Take the global logits; a task without them (round 1) means no distillation."""
        logits = received(payloads, "logits", PrototypeSet)
        if logits is None:
            self.valid.zero_()
            return
        c = self.ctx.num_classes
        if logits.class_ids.size and (logits.dim != c or int(logits.class_ids.max()) >= c):
            raise ValidationError(
                "payloads.logits",
                f"vectors of {c} logits, ids < {c}",
                (logits.dim, logits.class_ids.tolist()),
            )
        if logits.class_ids.size:
            self.table, self.valid = prototype_table(logits, c, self.ctx.device)
        else:
            self.valid.zero_()

    def train_phase(self, task: Task) -> PhaseResult:
        """One participation; the logit sums restart with it."""
        self._logits.reset(self.dp_clip())
        return super().train_phase(task)

    def step_loss(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> Tensor:
        """CE plus ``kd_weight`` times the distance to the global logit of each sample's class."""
        loss = F.cross_entropy(logits, y)
        mask = self.valid[y]
        cfg = self.config
        if cfg.kd_weight > 0 and bool(mask.any()):
            loss = loss + cfg.kd_weight * fd_kd_loss(logits, self.table[y], mask, cfg.kd_loss)
        return loss

    def after_step(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> None:
        """Per-class sums of this step's (pre-update, train-mode) logits."""
        self._logits.add(logits, y)

    def reply_payloads(self) -> dict[str, Payload]:
        """The per-class mean logits of this participation."""
        self.release([self._logits], self.config.local_epochs)
        return {"logits": self._logits.prototypes(self.config.logit_encoding)}

    def extra_state(self) -> dict[str, Tensor]:
        """The global logits survive restarts."""
        return {"fd_table": self.table.cpu(), "fd_valid": self.valid.cpu()}

    def load_extra_state(self, state: dict[str, Tensor]) -> None:
        """Restore the global logits if they fit this federation."""
        super().load_extra_state(state)
        table, valid = state.get("fd_table"), state.get("fd_valid")
        if table is not None and valid is not None and table.shape == self.table.shape:
            self.table, self.valid = table.to(self.ctx.device), valid.to(self.ctx.device).bool()
