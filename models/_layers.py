"""Small building blocks shared by the model modules."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["probe_output_dim"]


@torch.no_grad()
def probe_output_dim(module: nn.Module, in_chans: int, input_size: tuple[int, int]) -> int:
    """Flattened output width of ``module`` for one ``[1, in_chans, h, w]`` input.

    Used by fixed-size networks to size the Linear after their flatten from ``input_size``
    (computing it by hand per architecture is where off-by-one pooling bugs hide). The module
    runs in eval mode so BatchNorm accepts a single sample; its mode is restored afterwards.
    """
    was_training = module.training
    module.eval()
    try:
        out = module(torch.zeros(1, in_chans, *input_size))
    finally:
        module.train(was_training)
    return int(out[0].numel())
