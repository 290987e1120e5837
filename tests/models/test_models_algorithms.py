"""Velo's CVAE and FedKTL's ETF, cosine/ArcFace head, feature transformer and h'."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from models import (
    CVAE,
    ETFHead,
    FeatureTransformer,
    arcface_logits,
    attach_etf_head,
    create_model,
    etf_matrix,
    latent_projection,
)
from protocol.errors import ConfigError


def test_cvae_shapes_and_layout() -> None:
    # Prepare
    cvae = CVAE(32, 10, z_dim=16, embed_dim=16, hidden=64)
    s, y = torch.randn(4, 32), torch.tensor([0, 1, 2, 9])

    # Execute
    recon, mu, logvar = cvae(s, y)
    fake = cvae.generate(y, generator=torch.Generator().manual_seed(0))

    # Assert
    assert recon.shape == (4, 32) and mu.shape == logvar.shape == (4, 16)
    assert fake.shape == (4, 32) and cvae.training
    assert [type(m) for m in cvae.encoder] == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear]
    assert [type(m) for m in cvae.decoder] == [nn.Linear, nn.Linear]
    assert cvae.encoder[0].in_features == 32 + 16 and cvae.decoder[0].in_features == 16 + 16
    again = cvae.generate(y, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fake, again)


def test_cvae_paper_defaults_and_kl() -> None:
    cvae = CVAE(512, 10)
    assert cvae.z_dim == 1024 and cvae.embed.embedding_dim == 512
    mu, logvar = torch.zeros(2, 1024), torch.zeros(2, 1024)
    torch.testing.assert_close(CVAE.kl_divergence(mu, logvar), torch.zeros(2))
    with pytest.raises(ConfigError):
        CVAE(0, 10)


@pytest.mark.parametrize(("c", "k"), [(10, 10), (10, 32), (2, 2), (100, 100)])
def test_etf_geometry(c: int, k: int) -> None:
    v = etf_matrix(c, k, generator=torch.Generator().manual_seed(0))
    gram = v.T.double() @ v.double()
    assert v.shape == (k, c) and v.dtype == torch.float32
    torch.testing.assert_close(
        gram.diagonal(), torch.ones(c, dtype=torch.float64), atol=1e-5, rtol=0
    )
    off = gram[~torch.eye(c, dtype=torch.bool)]
    torch.testing.assert_close(off, torch.full_like(off, -1.0 / (c - 1)), atol=1e-5, rtol=0)


def test_etf_seeded_and_validated() -> None:
    a = etf_matrix(5, generator=torch.Generator().manual_seed(3))
    b = etf_matrix(5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    with pytest.raises(ConfigError, match="K >= C"):
        etf_matrix(10, 9)
    with pytest.raises(ConfigError):
        etf_matrix(1)


def test_arcface_margin_on_true_class_only() -> None:
    cos = torch.tensor([[0.5, 0.2, -0.1]])
    logits = arcface_logits(cos, torch.tensor([0]), scale=64.0, margin=0.5)
    assert logits[0, 0].item() == pytest.approx(64 * math.cos(math.acos(0.5) + 0.5), rel=1e-5)
    torch.testing.assert_close(logits[0, 1:], 64 * cos[0, 1:])
    plain = arcface_logits(cos, torch.tensor([0]), scale=1.0, margin=0.0)
    torch.testing.assert_close(plain, cos, atol=1e-6, rtol=0)


def test_etf_head_on_a_classifier() -> None:
    # Prepare
    model = create_model("mlp_m", num_classes=10, in_chans=1, feature_dim=32)
    etf = etf_matrix(10, generator=torch.Generator().manual_seed(0))

    # Execute
    head = attach_etf_head(model, etf)
    x, y = torch.rand(2, 1, 8, 8), torch.tensor([3, 4])
    cos = model(x)
    feats = model.forward_features(x)

    # Assert
    assert isinstance(model.get_classifier(), ETFHead) and model.num_classes == 10
    assert cos.shape == (2, 10) and (cos.abs() <= 1 + 1e-5).all()
    assert head.embed(feats).shape == (2, 10)
    assert head.arcface(feats, y).shape == (2, 10)
    assert "head.etf_t" in model.state_dict()
    torch.testing.assert_close(head.etf_t.norm(dim=1), torch.ones(10))


def test_feature_transformer_and_latent_projection() -> None:
    f = FeatureTransformer(10, 16)
    assert [type(m) for m in f.net] == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear]
    assert f.net[0].out_features == 10 and f(torch.randn(4, 10)).shape == (4, 16)
    h = latent_projection(32, 16)
    assert (h.in_features, h.out_features) == (32, 16) and h.bias is not None
