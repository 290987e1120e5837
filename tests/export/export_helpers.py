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
