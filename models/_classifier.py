"""The split classifier every registered architecture is built as.

A classifier is ``normalize -> trunk -> projection -> head``:

* ``normalize``: per-dataset mean/std, the first op of ``forward_features`` so that real and
  generated images (both in [0, 1]) take the same path and the ONNX model takes [0, 1] input
  (fedvtc.md §8-D7);
* ``trunk``: the architecture, images ``[B, C, H, W]`` -> native features ``[B, trunk_dim]``;
* ``proj``: ``Linear(trunk_dim, feature_dim)`` without activation when a federation-wide
  ``feature_dim`` is requested (fedvtc.md §8-D6: a projection, not adaptive pooling, because it
  exports to ONNX), else identity;
* ``head``: ``Linear(num_features, num_classes)``.

Algorithms only use ``forward_features``, ``forward_head(..., pre_logits=True)`` and
``get_classifier()``; they never probe attribute names of a particular backbone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from protocol.errors import ConfigError

__all__ = ["Classifier", "Normalize"]


class Normalize(nn.Module):
    """``(x - mean) / std`` per channel, with the statistics as non-persistent buffers.

    Non-persistent because the statistics are configuration (recorded in ``create_kwargs``),
    not learned state: state dicts of two clients of one architecture stay averageable even if
    their datasets were normalised differently.
    """

    mean: Tensor
    std: Tensor

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(list(mean)).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(list(std)).view(1, -1, 1, 1), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """Normalise ``x`` of shape ``[B, C, H, W]``."""
        return (x - self.mean) / self.std


_FEATURE_ACTS: dict[str, type[nn.Module]] = {"relu": nn.ReLU}


class Classifier(nn.Module):
    """An image classifier with timm's split interface.

    Attributes:
        num_features: Size ``D`` of the feature vector (``feature_dim`` when given).
        num_classes: Number of logits (0 when the head is an identity).
        in_chans: Input channels.
        input_size: The ``(h, w)`` the model was built for (export uses it for dummy input).
        trunk_dim: Native feature size of the trunk, before the projection.
        model_name: Registry name, set by ``create_model`` (None for hand-built instances).
        create_kwargs: Keyword arguments that rebuild the architecture with ``create_model``.
    """

    def __init__(
        self,
        trunk: nn.Module,
        trunk_dim: int,
        *,
        num_classes: int,
        feature_dim: int | None = None,
        in_chans: int = 3,
        input_size: tuple[int, int] = (32, 32),
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        feature_act: str | None = None,
    ) -> None:
        super().__init__()
        if feature_act is not None and feature_act not in _FEATURE_ACTS:
            raise ConfigError(
                f"feature_act: expected one of {sorted(_FEATURE_ACTS)} or None, got {feature_act!r}"
            )
        self.in_chans = in_chans
        self.input_size = input_size
        self.trunk_dim = trunk_dim
        self.model_name: str | None = None
        self.create_kwargs: dict[str, Any] = {}
        self.normalize: nn.Module = (
            nn.Identity() if mean is None or std is None else Normalize(mean, std)
        )
        self.trunk = trunk
        self.num_features = trunk_dim if feature_dim is None else feature_dim
        self.proj: nn.Module = (
            nn.Identity() if feature_dim is None else nn.Linear(trunk_dim, feature_dim)
        )
        self.feature_act: nn.Module = (
            nn.Identity() if feature_act is None else _FEATURE_ACTS[feature_act]()
        )
        self.num_classes = num_classes
        self.head: nn.Module = self._make_head(num_classes)

    def _make_head(self, num_classes: int) -> nn.Module:
        return nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()

    def forward_features(self, x: Tensor) -> Tensor:
        """Images in [0, 1], ``[B, C, H, W]`` -> features ``[B, num_features]``."""
        x = self.normalize(x)
        x = self.trunk(x)
        return self.feature_act(self.proj(x))  # type: ignore[no-any-return]

    def forward_head(self, features: Tensor, pre_logits: bool = False) -> Tensor:
        """Features ``[B, D]`` -> logits ``[B, num_classes]`` (or the features if pre_logits)."""
        if pre_logits:
            return features
        return self.head(features)  # type: ignore[no-any-return]

    def forward(self, x: Tensor) -> Tensor:
        """Images in [0, 1] -> logits; literally ``forward_head(forward_features(x))``."""
        return self.forward_head(self.forward_features(x))

    def get_classifier(self) -> nn.Module:
        """The head module mapping features to logits."""
        return self.head

    def reset_classifier(self, num_classes: int) -> None:
        """Replace the head with a freshly initialised one for ``num_classes`` (0: identity)."""
        if not isinstance(num_classes, int) or num_classes < 0:
            raise ConfigError(f"num_classes: expected an int >= 0, got {num_classes!r}")
        device = next(self.parameters()).device
        self.num_classes = num_classes
        self.head = self._make_head(num_classes).to(device)
        if "num_classes" in self.create_kwargs:
            self.create_kwargs["num_classes"] = num_classes

    def extractor_parameters(self) -> list[nn.Parameter]:
        """Parameters of everything before the head (trunk and projection)."""
        head_ids = {id(p) for p in self.head.parameters()}
        return [p for p in self.parameters() if id(p) not in head_ids]
