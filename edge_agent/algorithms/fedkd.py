"""FedKD, edge half: the private mentor and the shared mentee co-train in the one loop with
adaptive mutual distillation; only the mentee travels.

Three parameter groups share the main step: the mentor (``ctx.model``), the mentee (the shared
model of :class:`SharedModelEdge`) and ``W_h``, a local ``Linear(d_s, d_t)`` without bias that
maps the mentee's features onto the mentor's (never sent). The summed loss is
``L_t^t + L_t^s + w * (KL(p_s || p_t) + KL(p_t || p_s) + MSE(h_t, W_h h_s))`` with
``w = 1 / (L_t^t + L_t^s)`` taken as a weight (no gradient) and each KL's teacher detached; the
one hidden term sends each part the gradient of its own loss (mentor: ``h_t``; mentee and
``W_h``: ``W_h h_s``), so each group's optimiser steps on its own objective. ``teacher_grad``
follows HtFLlib's ``clientkd`` instead: it backpropagates two objectives that each hold the
hidden term, through the teachers and through ``w``.

The mentee travels SVD-compressed both ways (``protocol.contract.lowrank``): a received one is
checked
and multiplied out before it is loaded; the upload keeps ``svd_energy(round)`` of each matrix.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from edge_agent.algorithms.base import EdgeContext, PhaseResult, register_edge_algorithm
from edge_agent.algorithms.shared_model import SharedModelEdge
from edge_agent.distillation import mutual_kl
from edge_agent.trainer import ParamGroup
from models.seeding import derived_seed, seeded
from protocol.algorithms.fedkd import FedKDConfig
from protocol.contract.lowrank import compress, restore
from protocol.contract.messages import Task
from protocol.contract.payloads import Payload, TensorMap

__all__ = ["FedKDEdge", "adaptive_kd_loss"]

_WH = "fedkd_wh."  # prefix of W_h's tensors in the checkpoint's extra state


def adaptive_kd_loss(  # noqa: PLR0917 - the terms of the two objectives, in order
    mentor_logits: Tensor,
    mentee_logits: Tensor,
    y: Tensor,
    mentor_hidden: Tensor | None = None,
    mapped_mentee_hidden: Tensor | None = None,
    kl_reduction: str = "batchmean",
    *,
    teacher_grad: bool = False,
) -> Tensor:
    """``L_mentor + L_mentee`` of FedKD (see the module doc); hidden term when both are given.
    ``teacher_grad``: HtFLlib's form (nothing detached, the hidden term in both objectives)."""
    ce_t = F.cross_entropy(mentor_logits, y)
    ce_s = F.cross_entropy(mentee_logits, y)
    detach = not teacher_grad
    distil = mutual_kl(mentor_logits, mentee_logits, kl_reduction, detach_teacher=detach)
    distil = distil + mutual_kl(mentee_logits, mentor_logits, kl_reduction, detach_teacher=detach)
    if mentor_hidden is not None and mapped_mentee_hidden is not None:
        hidden = F.mse_loss(mentor_hidden.float(), mapped_mentee_hidden.float())
        distil = distil + (2 * hidden if teacher_grad else hidden)
    task = ce_t + ce_s
    weight = 1.0 / (task if teacher_grad else task.detach()).clamp_min(1e-8)
    return task + weight * distil


@register_edge_algorithm("fedkd")
class FedKDEdge(SharedModelEdge[FedKDConfig]):
    """Mentor, mentee and the local ``W_h`` on one adaptive mutual-distillation loss."""

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        self.w_h: nn.Linear | None = None
        self._restored_wh: dict[str, Tensor] | None = None
        self._round = 1  # of the task being handled: the upload's compression energy

    def handle(self, task: Task) -> PhaseResult:
        """Remember the round (its energy), then the phase."""
        self._round = task.round
        return super().handle(task)

    def receive(self, payloads: dict[str, Payload]) -> None:
        """The global mentee, its factors checked and multiplied out."""
        w = payloads.get("weights")
        if isinstance(w, TensorMap):
            payloads = {**payloads, "weights": restore(w, "payloads.weights")}
        super().receive(payloads)

    def reply_payloads(self) -> dict[str, Payload]:
        """The mentee, compressed at this round's energy when the run asks for it."""
        payloads = super().reply_payloads()
        w = payloads.get("weights")
        if self.config.svd and isinstance(w, TensorMap):
            payloads = {**payloads, "weights": compress(w, self.config.svd_energy(self._round))}
        return payloads

    def hidden_map(self) -> nn.Linear:
        """``W_h`` (built on first use, seeded per device, restored from a checkpoint)."""
        if self.w_h is None:
            d_s, d_t = self.shared_net().num_features, self.ctx.model.num_features
            seed = derived_seed(int(self.ctx.generator.initial_seed()), "fedkd-wh")
            with seeded(seed):
                self.w_h = nn.Linear(d_s, d_t, bias=False).to(self.ctx.device)
            state = self._restored_wh
            if state is not None and state.get("weight", Tensor()).shape == self.w_h.weight.shape:
                self.w_h.load_state_dict(state)
        return self.w_h

    def param_groups(self) -> list[ParamGroup]:
        """Mentor, mentee and ``W_h``, each with its own optimiser and clipping."""
        groups = super().param_groups()
        if self.config.hidden_loss:
            groups.append(ParamGroup("w_h", self.hidden_map(), lr=self.config.wh_lr or None))
        return groups

    def step_loss(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> Tensor:
        """Both objectives summed (the mentor's ``features`` and ``logits`` come from the loop)."""
        mentee = self.shared_net()
        h_s = mentee.forward_features(x)
        z_s = mentee.forward_head(h_s)
        mapped = self.hidden_map()(h_s) if self.config.hidden_loss else None
        hidden = features if mapped is not None else None
        cfg = self.config
        return adaptive_kd_loss(
            logits, z_s, y, hidden, mapped, cfg.kl_reduction, teacher_grad=cfg.teacher_grad
        )

    def extra_state(self) -> dict[str, Tensor]:
        """The mentee (inherited) and ``W_h`` survive restarts."""
        out = super().extra_state()
        if self.w_h is not None:
            out.update({_WH + k: v.detach().cpu() for k, v in self.w_h.state_dict().items()})
        return out

    def load_extra_state(self, state: dict[str, Tensor]) -> None:
        """Keep ``W_h``'s tensors until the models exist."""
        super().load_extra_state(state)
        wh = {k[len(_WH) :]: v for k, v in state.items() if k.startswith(_WH)}
        self._restored_wh = wh or None
