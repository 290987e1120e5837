"""FML, edge half: the private model and the shared meme co-train by deep mutual learning in
the one loop; only the meme travels.

Both models are parameter groups of the main step on one summed loss. Each model's KL term
treats the other's prediction as a constant target (the teacher's logits are detached), so the
gradient of the sum w.r.t. each model is the gradient of its own loss and each group's own
optimiser steps it, as two optimisers on two losses would. ``teacher_grad`` leaves the teachers
attached, as HtFLlib's two backward passes do: each model then also gets the gradient of the
other's KL term. :class:`SharedModelEdge` holds what FML and FedKD share: the meme built from
the task's ``shared_model`` with one fleet-wide seed, exchanged, checkpointed and evaluated.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from edge_agent.algorithms.base import register_edge_algorithm
from edge_agent.algorithms.shared_model import SharedModelEdge
from edge_agent.distillation import mutual_kl
from protocol.algorithms.fml import FMLConfig

__all__ = ["FMLEdge"]


@register_edge_algorithm("fml")
class FMLEdge(SharedModelEdge[FMLConfig]):
    """Deep mutual learning between the private model and the meme."""

    def step_loss(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> Tensor:
        """``L_private + L_meme`` (see the module doc); teachers detached unless
        ``teacher_grad``."""
        cfg = self.config
        zm = self.shared_net()(x)
        detach = not cfg.teacher_grad
        private = cfg.alpha * F.cross_entropy(logits, y) + (1 - cfg.alpha) * mutual_kl(
            logits, zm, cfg.kl_reduction, detach_teacher=detach
        )
        meme = cfg.beta * F.cross_entropy(zm, y) + (1 - cfg.beta) * mutual_kl(
            zm, logits, cfg.kl_reduction, detach_teacher=detach
        )
        return private + meme
