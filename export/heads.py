"""Inference heads in PyTorch: what the exported graph computes after the feature extractor.

An export is two graphs joined at the ``features`` tensor: the classifier's
``forward_features`` (the *trunk*) and a small head mapping features ``[B, D]`` to
``scores [B, C]`` float32 and ``label [B]`` int64. Keeping the head a separate module lets the
fp16/int8 variants convert the trunk only: squared prototype distances overflow float16 for
feature norms above ~256, and int8 rounding of ``|f|^2 - 2 f.p + |p|^2`` cancels
catastrophically, so the head always stays float32 (it is a few KB).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models import Classifier
from models.checkpoint import HeadSpec
from protocol.errors import ExportError

__all__ = [
    "MASKED_SCORE",
    "CosineHead",
    "FeatureTrunk",
    "InferenceModel",
    "LogitsHead",
    "PrototypeHead",
    "make_head",
    "with_head",
]

# Score of an invalid class: the most negative finite float32, so that it loses to any finite
# score yet keeps softmax and comparisons free of inf/NaN arithmetic.
MASKED_SCORE = float(torch.finfo(torch.float32).min)


class FeatureTrunk(nn.Module):
    """``model.forward_features`` as a module: images ``[B, C, H, W]`` -> ``[B, D]``."""

    def __init__(self, model: Classifier) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        """Features of images in [0, 1]."""
        return self.model.forward_features(x)


class LogitsHead(nn.Module):
    """The classifier's own head: scores are its logits."""

    def __init__(self, model: Classifier) -> None:
        super().__init__()
        self.head = model.get_classifier()

    def forward(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """``[B, D]`` -> (logits ``[B, C]``, argmax ``[B]``)."""
        scores = self.head(features)
        return scores, scores.argmax(dim=1)


class PrototypeHead(nn.Module):
    """Nearest global prototype: scores are negative squared L2 distances, invalid masked."""

    protos_t: Tensor
    proto_sq: Tensor
    valid: Tensor

    def __init__(self, prototypes: Tensor, valid: Tensor) -> None:
        super().__init__()
        p = prototypes.detach().to(torch.float32)
        # |f - p|^2 = |f|^2 - 2 f.p + |p|^2: one MatMul instead of a [B, C, D] broadcast;
        # the prototype side is precomputed and baked into the graph as constants.
        self.register_buffer("protos_t", p.t().contiguous())
        self.register_buffer("proto_sq", (p * p).sum(dim=1))
        self.register_buffer("valid", valid.detach().to(torch.bool))
        self.masked = not bool(self.valid.all())

    def forward(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """``[B, D]`` -> (``-|f - p_c|^2`` ``[B, C]``, nearest valid class ``[B]``)."""
        f_sq = (features * features).sum(dim=1, keepdim=True)
        dist = f_sq - 2.0 * (features @ self.protos_t) + self.proto_sq
        scores = _mask(-dist, self.valid) if self.masked else -dist
        return scores, scores.argmax(dim=1)


class CosineHead(nn.Module):
    """FedKTL's ETF head: normalised features · row-normalised fixed vectors (fedktl.md §9.2)."""

    vectors_t: Tensor
    valid: Tensor

    def __init__(self, vectors: Tensor, valid: Tensor, eps: float = 1e-12) -> None:
        super().__init__()
        v = vectors.detach().to(torch.float32)
        v = v / v.norm(dim=1, keepdim=True).clamp_min(eps)
        self.register_buffer("vectors_t", v.t().contiguous())
        self.register_buffer("valid", valid.detach().to(torch.bool))
        self.masked = not bool(self.valid.all())
        self.eps = eps

    def forward(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """``[B, D]`` -> (cosine similarities ``[B, C]``, argmax ``[B]``)."""
        norm = features.norm(dim=1, keepdim=True).clamp_min(self.eps)
        scores = (features / norm) @ self.vectors_t
        scores = _mask(scores, self.valid) if self.masked else scores
        return scores, scores.argmax(dim=1)


def _mask(scores: Tensor, valid: Tensor) -> Tensor:
    """Invalid classes get ``MASKED_SCORE`` (heads skip this when every class is valid)."""
    return torch.where(valid, scores, MASKED_SCORE)


class InferenceModel(nn.Module):
    """Trunk and head composed: the PyTorch reference the ONNX export is verified against."""

    def __init__(self, trunk: FeatureTrunk, head: nn.Module) -> None:
        super().__init__()
        self.trunk = trunk
        self.head = head

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Images in [0, 1] ``[B, C, H, W]`` -> (scores ``[B, C]``, label ``[B]``)."""
        out: tuple[Tensor, Tensor] = self.head(self.trunk(x))
        return out


def make_head(model: Classifier, head: HeadSpec) -> nn.Module:
    """The head module for ``head`` on top of ``model``'s features, in eval mode.

    Raises:
        ExportError: The prototype width does not match ``model.num_features``, or a logits
            head is asked of a model without classifier.
    """
    if head.type == "logits":
        if model.num_classes <= 0:
            raise ExportError("logits head: the model has no classifier (num_classes=0)")
        return LogitsHead(model).eval()
    protos, valid = head.prototypes, head.valid_mask()
    if protos is None or valid is None:  # unreachable: HeadSpec validates non-logits heads
        raise ExportError(f"{head.type} head: no prototypes")
    if protos.shape[1] != model.num_features:
        raise ExportError(
            f"{head.type} head: prototypes are [{protos.shape[0]}, {protos.shape[1]}] but the "
            f"model's features have {model.num_features} dimensions"
        )
    module = PrototypeHead(protos, valid) if head.type == "prototype" else CosineHead(protos, valid)
    return module.eval()


def with_head(model: Classifier, head: HeadSpec) -> InferenceModel:
    """``model`` with the inference ``head`` attached, in eval mode (shares ``model``'s weights).

    The head's constants move to the model's device, so a model trained on a GPU exports as is.
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return InferenceModel(FeatureTrunk(model), make_head(model, head).to(device)).eval()
