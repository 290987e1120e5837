"""The PyTorch inference heads against independent formulas (no ONNX involved)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from export.heads import MASKED_SCORE, make_head, with_head
from models import create_model
from models.checkpoint import HeadSpec
from protocol.errors import ExportError


def test_prototype_head_is_negative_squared_distance() -> None:
    model = create_model("mlp_s", num_classes=10, in_chans=1, input_size=8)
    protos = torch.randn(10, model.num_features) * 3
    head = make_head(model, HeadSpec("prototype", protos))
    f = torch.randn(16, model.num_features) * 3
    scores, label = head(f)
    expected = -torch.cdist(f.double(), protos.double()).pow(2)
    torch.testing.assert_close(scores.double(), expected, atol=1e-3, rtol=1e-5)
    assert torch.equal(label, expected.argmax(1))


def test_invalid_prototype_never_wins_even_when_nearest() -> None:
    model = create_model("mlp_s", num_classes=10, in_chans=1, input_size=8)
    f = torch.randn(32, model.num_features)
    protos = torch.randn(10, model.num_features) * 10
    protos[3] = f.mean(0)  # class 3 is the nearest for most samples ...
    valid = torch.ones(10, dtype=torch.bool)
    valid[3] = False  # ... but it has no valid global prototype
    unmasked = make_head(model, HeadSpec("prototype", protos))(f)[1]
    scores, label = make_head(model, HeadSpec("prototype", protos, valid))(f)
    assert (unmasked == 3).float().mean() > 0.5
    assert not (label == 3).any()
    assert torch.all(scores[:, 3] == MASKED_SCORE)


def test_cosine_head_matches_normalised_dot_product() -> None:
    model = create_model("mlp_s", num_classes=10, in_chans=1, input_size=8)
    vectors = torch.randn(10, model.num_features)
    scores, label = make_head(model, HeadSpec("cosine", vectors))(f := torch.randn(8, 64) * 5)
    expected = F.normalize(f, dim=1) @ F.normalize(vectors, dim=1).T
    torch.testing.assert_close(scores, expected)
    assert scores.abs().max() <= 1.0 + 1e-6
    assert torch.equal(label, expected.argmax(1))


def test_logits_head_is_the_model() -> None:
    model = create_model("cnn_t1", num_classes=10, in_chans=1, input_size=8).eval()
    x = torch.rand(4, 1, 8, 8)
    scores, label = with_head(model, HeadSpec("logits"))(x)
    torch.testing.assert_close(scores, model(x))
    assert label.dtype == torch.int64


def test_prototype_width_must_match_features() -> None:
    model = create_model("mlp_s", num_classes=10, in_chans=1, input_size=8)
    with pytest.raises(
        ExportError,
        match=r"prototypes are \[10, 5\] but the model's features "
        r"have 64 dimensions",
    ):
        make_head(model, HeadSpec("prototype", torch.randn(10, 5)))
