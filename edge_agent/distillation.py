"""Knowledge-distillation terms shared by the algorithms that co-train two models on one device
(FedType's proxy and private model, FML's meme, FedKD's mentee)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

__all__ = ["forward_kd", "mutual_kl"]


def forward_kd(
    proxy_logits: Tensor,
    private_logits: Tensor,
    temperature: float = 1.0,
    *,
    detach_teacher: bool = True,
) -> Tensor:
    """Eq. 1: ``KL(softmax(w / T) || softmax(p / T)) * T^2``, per-sample mean, teacher detached
    unless ``detach_teacher`` is false (then the teacher's logits get the gradient too)."""
    t = temperature
    teacher = private_logits.detach() if detach_teacher else private_logits
    kl = F.kl_div(
        F.log_softmax(proxy_logits.float() / t, dim=1),
        F.softmax(teacher.float() / t, dim=1),
        reduction="batchmean",
    )
    return kl * t * t


def mutual_kl(
    student: Tensor, teacher: Tensor, reduction: str = "batchmean", *, detach_teacher: bool = True
) -> Tensor:
    """``KL(softmax teacher || softmax student)`` with the teacher detached (unless
    ``detach_teacher`` is false): per sample (``batchmean``) or also divided by the number of
    classes (``elementwise_mean``)."""
    kl = forward_kd(student, teacher, detach_teacher=detach_teacher)
    return kl / student.shape[1] if reduction == "elementwise_mean" else kl
