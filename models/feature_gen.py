"""FedGen's label-conditional feature generator, built by both halves from one definition.

The coordinator trains it and the agents run it, so the layout lives here, where both may import
it (the edge never imports the coordinator).
"""

from __future__ import annotations

from torch import nn

__all__ = ["feature_generator"]


def feature_generator(
    noise_dim: int, num_classes: int, hidden: int, feature_dim: int
) -> nn.Sequential:
    """``[noise, one-hot label] -> Linear -> BatchNorm -> ReLU -> Linear -> feature``."""
    return nn.Sequential(
        nn.Linear(noise_dim + num_classes, hidden),
        nn.BatchNorm1d(hidden),
        nn.ReLU(),
        nn.Linear(hidden, feature_dim),
    )
