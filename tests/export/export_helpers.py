"""Helpers shared by the export tests (imported by name: tests/export is on sys.path)."""

from __future__ import annotations

import numpy as np
import torch

from models.checkpoint import HeadSpec

CLASS_NAMES = [f"digit-{i}" for i in range(10)]


def make_head(kind: str, num_features: int, invalid: tuple[int, ...] = ()) -> HeadSpec:
    """A head of ``kind`` with random prototypes and ``invalid`` classes masked."""
    if kind == "logits":
        return HeadSpec("logits")
    valid = torch.ones(10, dtype=torch.bool)
    valid[list(invalid)] = False
    return HeadSpec(kind, torch.randn(10, num_features), valid)  # type: ignore[arg-type]


def images(n: int, shape: tuple[int, ...] = (1, 8, 8), seed: int = 0) -> np.ndarray:
    """``n`` uniform [0, 1] float32 images."""
    return np.random.default_rng(seed).random((n, *shape), dtype=np.float32)


@torch.no_grad()
def calibrate_batchnorm(model: torch.nn.Module, x: np.ndarray) -> torch.nn.Module:
    """Set every BatchNorm's running statistics from ``x`` and return ``model`` in eval mode.

    Freshly initialised deep networks are degenerate in eval mode (unit running variance):
    ResNet-152's logits reach ~1e7 and EfficientNet/GoogLeNet/MobileNet features vanish to
    ~1e-12, so an ONNX comparison would only check the classifier bias. Statistics from real
    forward passes give activations of order one, where a trunk error shows.
    """
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for bn in norms:
        bn.reset_running_stats()
        bn.momentum = None  # cumulative average over the calibration batches
    model.train()
    for start in range(0, len(x), 16):
        model(torch.from_numpy(x[start : start + 16]))
    return model.eval()
