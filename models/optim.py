"""Adam for both training loops: the edge's (:mod:`edge_agent.trainer`) and the server's
(:func:`models.fit.fit`).

torch's fused kernel updates every tensor in one call where this torch has one for the
parameters' device (CUDA; the CPU from torch 2.4), the per-tensor loop elsewhere. On one CPU
core the update of Velo's 5.25 M-parameter CVAE takes 5-6 ms against the loop's 24-34 ms, and
its training runs at 1.4-1.6x the sample-epochs a second (``benchmarks/bench_velo_cvae.py``); the
edge loop trains ``hcnn2_1024`` at batch 10 at 1.5x the samples a second
(``benchmarks/bench_trainloop.py --optimizer adam``). The update is Adam's, equal to the
loop's up to float rounding: a run replays exactly under one torch, not across one that lacks
the kernel.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["adam"]


def adam(params: Iterable[Tensor], lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """Adam over ``params`` (all on one device), fused where the kernel exists."""
    group = list(params)
    try:
        return torch.optim.Adam(group, lr=lr, weight_decay=weight_decay, fused=True)
    except (RuntimeError, TypeError):  # no fused kernel for this device, dtype or torch
        return torch.optim.Adam(group, lr=lr, weight_decay=weight_decay)
