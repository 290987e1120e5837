"""Knowledge-distillation terms shared by the algorithms that co-train two models on one device
(FedType's proxy and private model, FML's meme, FedKD's mentee)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

__all__ = ["forward_kd", "mutual_kl"]


def forward_kd(proxy_logits: Tensor, private_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Eq. 1: ``KL(softmax(w / T) || softmax(p / T)) * T^2``, per-sample mean, teacher detached."""
    t = temperature
    kl = F.kl_div(
        F.log_softmax(proxy_logits.float() / t, dim=1),
        F.softmax(private_logits.detach().float() / t, dim=1),
        reduction="batchmean",
    )
    return kl * t * t


def mutual_kl(student: Tensor, teacher: Tensor, reduction: str = "batchmean") -> Tensor:
    """``KL(softmax teacher || softmax student)`` with the teacher detached: per sample
    (``batchmean``) or also divided by the number of classes (``elementwise_mean``)."""
    kl = forward_kd(student, teacher)
    return kl / student.shape[1] if reduction == "elementwise_mean" else kl
