"""Split conformal prediction with RAPS sets, for FedType (``shared/specs/fedtype.md`` §4.4-4.6).

Pure torch, no training loop: "training" a conformal model is fitting one temperature on the
calibration split and taking the exact ``ceil((n + 1)(1 - theta))``-th smallest non-conformity
score as the threshold ``tau``. The RAPS score of the label at sorted rank ``k`` (1-based) is::

    E_k = (sum of the k-1 larger probabilities) + u * pi_(k) + penalty * max(0, k - k_reg)

It is non-decreasing in ``k``, so a prediction set ``{k : E_k <= tau}`` is always a top-k
prefix. Calibration scores and prediction sets come from the same :func:`rank_scores`, so a
label is in its set exactly when its calibration-style score is at most ``tau``.

Sets are boolean masks ``[batch, C]`` in label order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "Calibration",
    "GFunction",
    "calibrate",
    "consensus",
    "fit_temperature",
    "g_penalty",
    "label_scores",
    "prediction_sets",
    "rank_scores",
    "split_quantile",
    "topk_sets",
    "uniform",
]

GFunction = Literal["piecewise_linear", "constant", "quadratic", "quadratic_linear"]


@dataclass(frozen=True)
class Calibration:
    """A conformal wrapper around one frozen model: temperature, threshold, RAPS settings.

    ``tau`` is ``None`` when the calibration split is too small for the requested coverage
    (``ceil((n + 1)(1 - theta)) > n``, spec §9-11): such a wrapper must not be used.
    """

    temperature: float
    tau: float | None
    penalty: float  # the RAPS penalty the scores were calibrated with
    k_reg: int
    n: int

    @property
    def valid(self) -> bool:
        """Whether the threshold exists."""
        return self.tau is not None


def fit_temperature(
    logits: Tensor,
    labels: Tensor,
    *,
    init: float = 1.3,
    lr: float = 0.01,
    max_iters: int = 10,
    tol: float = 0.01,
    batch_size: int = 32,
) -> float:
    """Temperature scaling by SGD on the NLL (RAPS's ``platt``): passes over ``logits`` in
    batches of ``batch_size``, stopping when one pass moves T by less than ``tol``."""
    if len(labels) == 0:
        return init
    t = torch.tensor(init, dtype=torch.float32, device=logits.device, requires_grad=True)
    opt = torch.optim.SGD([t], lr=lr)
    z = logits.detach().float()
    with torch.enable_grad():
        for _ in range(max_iters):
            # a float copy: aliasing the parameter would stop the loop after one pass
            before = float(t.detach())
            for start in range(0, len(labels), batch_size):
                opt.zero_grad(set_to_none=True)
                end = start + batch_size
                loss = F.cross_entropy(z[start:end] / t, labels[start:end])
                loss.backward()  # type: ignore[no-untyped-call]  # torch stub
                opt.step()
            if abs(before - float(t.detach())) < tol:
                break
    return float(t.detach())


def rank_scores(probs: Tensor, u: Tensor, penalty: float, k_reg: int) -> tuple[Tensor, Tensor]:
    """RAPS scores of every sorted rank, ``[b, C]``, and the sort order (label of each rank)."""
    p_sorted, order = probs.sort(dim=1, descending=True)
    ranks = torch.arange(1, probs.shape[1] + 1, device=probs.device, dtype=probs.dtype)
    reg = penalty * (ranks - k_reg).clamp(min=0)
    scores = p_sorted.cumsum(dim=1) - p_sorted + u.unsqueeze(1) * p_sorted + reg
    return scores, order


def label_scores(probs: Tensor, labels: Tensor, u: Tensor, penalty: float, k_reg: int) -> Tensor:
    """Non-conformity score of each sample's true label, ``[n]`` (Eq. 5)."""
    scores, order = rank_scores(probs, u, penalty, k_reg)
    position = (order == labels.unsqueeze(1)).int().argmax(dim=1, keepdim=True)
    return scores.gather(1, position).squeeze(1)


def split_quantile(scores: Tensor, theta: float) -> float | None:
    """The exact ``k``-th smallest score, ``k = ceil((n + 1)(1 - theta))`` (1-based; App. B
    step 3), or ``None`` when ``k > n``."""
    n = int(scores.numel())
    k = math.ceil((n + 1) * (1 - theta) - 1e-9)  # 1e-9: (n+1)(1-theta) integral in exact maths
    if k > n or n == 0:
        return None
    return float(scores.sort().values[k - 1])


def calibrate(
    logits: Tensor,
    labels: Tensor,
    *,
    theta: float,
    penalty: float,
    k_reg: int,
    generator: torch.Generator,
    temperature: float | None = None,
    platt: dict[str, float] | None = None,
) -> Calibration:
    """Fit T (unless ``temperature`` is given), score the true labels with randomised RAPS
    (``u`` from ``generator``, zero sets allowed) and take the split-conformal quantile."""
    if temperature is None:
        temperature = fit_temperature(logits, labels, **(platt or {}))  # type: ignore[arg-type]
    probs = F.softmax(logits.detach().float() / temperature, dim=1)
    u = uniform(len(labels), generator, probs.device)
    tau = split_quantile(label_scores(probs, labels, u, penalty, k_reg), theta)
    return Calibration(temperature, tau, penalty, k_reg, len(labels))


def uniform(n: int, generator: torch.Generator, device: torch.device) -> Tensor:
    """``n`` draws of U(0, 1) from ``generator`` (a CPU stream, reproducible on any device)."""
    return torch.rand(n, generator=generator).to(device)


def prediction_sets(
    logits: Tensor,
    cal: Calibration,
    u: Tensor,
    *,
    penalty: float | None = None,
    allow_empty: bool = False,
) -> Tensor:
    """Eq. 6: the labels whose RAPS score is at most ``tau``, as a mask ``[b, C]``.

    ``penalty`` overrides the calibrated one (the calibration function g shrinks the proxy's
    sets this way); unless ``allow_empty``, an empty set keeps its top-1 label (RAPS default).
    """
    if cal.tau is None:
        raise ValueError("prediction_sets: the calibration split was too small (tau is None)")
    pen = cal.penalty if penalty is None else penalty
    probs = F.softmax(logits.detach().float() / cal.temperature, dim=1)
    scores, order = rank_scores(probs, u, pen, cal.k_reg)
    keep = scores <= cal.tau
    if not allow_empty:
        keep[:, 0] = True
    return torch.zeros_like(keep).scatter(1, order, keep)


def topk_sets(logits: Tensor, k: int) -> Tensor:
    """The ``k`` largest logits of each row as a mask (the FedType_TopK ablation)."""
    idx = logits.topk(min(k, logits.shape[1]), dim=1).indices
    return torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)


def g_penalty(delta: float, lam: float, kind: GFunction = "piecewise_linear") -> float:
    """The calibration function g(Delta, lambda) of Eq. 7 and its Fig. 3 alternatives; all
    equal ``lam`` when the proxy's accuracy did not drop (``delta >= 0``)."""
    if delta >= 0 or kind == "constant":
        return lam
    if kind == "piecewise_linear":  # g1 = lambda*Delta - Delta + lambda
        return lam * delta - delta + lam
    if kind == "quadratic":  # g3
        return lam * delta * delta + lam
    return -lam * delta * delta - delta + lam  # g4


def consensus(s: Tensor, l_set: Tensor) -> Tensor:
    """Eq. 8 per sample: ``|S & L| / |S | L|`` when ``|S| >= |L|``, else ``|S & L| / |S|``."""
    inter = (s & l_set).sum(dim=1).float()
    size_s, size_l = s.sum(dim=1), l_set.sum(dim=1)
    union = (s | l_set).sum(dim=1).float()
    eta = torch.where(size_s >= size_l, inter / union.clamp(min=1), inter / size_s.clamp(min=1))
    return eta
