"""FedKTL's building blocks against hand-computed values: ArcFace, the MMD, the ETF set-up
(K >= C enforced) and the conversion of generated images to each agent's input spec."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import coordinator.strategies.fedktl.strategy
import edge_agent.algorithms.fedktl  # noqa: F401  (registers both halves)
from coordinator.strategies.fedktl.server import make_setup, to_input_spec
from models.ktl import arcface_logits, median_bandwidths, mmd2_rbf, rbf_kernel
from protocol.algorithms.fedktl import setup_digest
from protocol.errors import ConfigError

_ = coordinator.strategies.fedktl.strategy


def test_arcface_loss_matches_hand_computed_value() -> None:
    # Prepare: cosines of one sample with three class vectors, true class 0
    cos, y, s, m = torch.tensor([[0.6, 0.0, -0.6]]), torch.tensor([0]), 2.0, 0.5
    target = math.cos(math.acos(0.6) + m)  # cos(theta_y + m) = 0.6 cos .5 - 0.8 sin .5
    logits = [s * target, 0.0, s * -0.6]
    expected = -logits[0] + math.log(sum(math.exp(v) for v in logits))

    # Execute
    loss = F.cross_entropy(arcface_logits(cos, y, s, m), y)

    # Assert
    assert target == pytest.approx(0.6 * math.cos(0.5) - 0.8 * math.sin(0.5))
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_arcface_gradient_is_finite_at_cosine_one() -> None:
    cos = torch.tensor([[1.0, -1.0]], requires_grad=True)
    F.cross_entropy(arcface_logits(cos, torch.tensor([0])), torch.tensor([0])).backward()
    assert cos.grad is not None and torch.isfinite(cos.grad).all()


def test_mmd_matches_hand_computed_value_and_vanishes_on_equal_samples() -> None:
    x, y = torch.tensor([[0.0]]), torch.tensor([[1.0]])
    # k(x,x) = k(y,y) = 1, k(x,y) = exp(-0.5 * 1 / 1)
    assert mmd2_rbf(x, y, (1.0,)).item() == pytest.approx(2 - 2 * math.exp(-0.5))
    # two bandwidths add their kernels: exp(-0.5/1) + exp(-0.5/2)
    both = 2 * 2 - 2 * (math.exp(-0.5) + math.exp(-0.25))
    assert mmd2_rbf(x, y, (1.0, 2.0)).item() == pytest.approx(both, rel=1e-6)
    z = torch.randn(6, 4)
    assert mmd2_rbf(z, z).item() == pytest.approx(0.0, abs=1e-6)
    # the biased estimator's diagonals: two points at distance 2, bandwidth 1
    pair = torch.tensor([[0.0], [2.0]])
    assert rbf_kernel(pair, pair, (1.0,)).mean().item() == pytest.approx((2 + 2 * math.exp(-2)) / 4)


def test_weighted_mmd_takes_each_x_row_by_its_share_of_the_weights() -> None:
    x, y = torch.tensor([[0.0], [2.0]]), torch.tensor([[1.0]])
    a = torch.tensor([3.0, 1.0])  # shares 3/4, 1/4
    e1, e4 = math.exp(-0.5), math.exp(-2.0)  # k at distance 1 and 2, bandwidth 1
    xx = 0.75**2 + 0.25**2 + 2 * 0.75 * 0.25 * e4
    assert mmd2_rbf(x, y, (1.0,), x_weights=a).item() == pytest.approx(xx + 1 - 2 * e1, rel=1e-6)
    # equal weights: the plain estimator; a zero weight: the row left out
    z, w = torch.randn(5, 3), torch.randn(4, 3)
    plain = mmd2_rbf(z, w).item()
    assert mmd2_rbf(z, w, x_weights=torch.full((5,), 0.3)).item() == pytest.approx(plain, rel=1e-5)
    drop = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    assert mmd2_rbf(z, w, x_weights=drop).item() == pytest.approx(
        mmd2_rbf(z[:4], w).item(), rel=1e-5
    )


def test_mmd_gradient_is_finite_with_duplicate_points() -> None:
    x = torch.zeros(3, 5, requires_grad=True)
    mmd2_rbf(x, torch.randn(3, 5)).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_median_bandwidths_scale_with_the_latents() -> None:
    # H = 100 Gaussians: squared distances ~ 200, far above the fixed bandwidths
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 100, generator=gen), torch.randn(64, 100, generator=gen)
    bws = median_bandwidths(x, y)
    assert bws[1] == pytest.approx(100, rel=0.1)  # half the median squared distance ~ 200 / 2
    # the fixed {10, 15, 20, 50} sum to ~0.14 there, the median ones to ~1.9
    assert rbf_kernel(x, y, bws).mean() > 5 * rbf_kernel(x, y).mean()


@pytest.mark.parametrize(("c", "k"), [(10, 10), (4, 9)])
def test_setup_etf_geometry_and_projection(c: int, k: int) -> None:
    # Execute
    setup = make_setup(c, k, feature_dim=6, latent_dim=5, seed=3)

    # Assert: unit columns with pairwise cosine -1/(C-1); h' = Linear(6, 5) in U(+-1/sqrt 6)
    v = setup["etf"]
    assert v.shape == (k, c) and v.dtype == np.float32
    gram = v.T @ v
    np.testing.assert_allclose(np.diag(gram), 1.0, atol=1e-5)
    np.testing.assert_allclose(gram[~np.eye(c, dtype=bool)], -1 / (c - 1), atol=1e-5)
    assert setup["proj.weight"].shape == (5, 6) and setup["proj.bias"].shape == (5,)
    assert np.abs(setup["proj.weight"]).max() <= 1 / math.sqrt(6)
    # seeded: the same seed gives the same digest, another seed another one
    assert setup_digest(make_setup(c, k, 6, 5, seed=3)) == setup_digest(setup)
    assert setup_digest(make_setup(c, k, 6, 5, seed=4)) != setup_digest(setup)


def test_setup_refuses_fewer_etf_dimensions_than_classes() -> None:
    with pytest.raises(ConfigError, match="K=9 < num_classes C=10"):
        make_setup(10, 9, feature_dim=4, latent_dim=4, seed=0)


def test_images_reach_each_input_spec_as_uint8() -> None:
    # Prepare: two constant 64x64 RGB images, so resizing keeps every pixel's value
    rgb = torch.tensor([[0.2, 0.5, 0.9], [1.0, 0.0, 0.0]]).view(2, 3, 1, 1).expand(2, 3, 64, 64)
    luma = [0.299 * 0.2 + 0.587 * 0.5 + 0.114 * 0.9, 0.299]

    # Execute
    grey8 = to_input_spec(rgb, 1, 8, 8)
    rgb12 = to_input_spec(rgb, 3, 12, 12)
    wide = to_input_spec(rgb, 1, 6, 10)

    # Assert: shapes, dtype, ITU-R 601 luma for grey, exact 8-bit quantisation
    assert grey8.shape == (2, 1, 8, 8) and grey8.dtype == np.uint8
    assert rgb12.shape == (2, 3, 12, 12) and wide.shape == (2, 1, 6, 10)
    assert grey8[:, 0, 0, 0].tolist() == [round(255 * v) for v in luma]
    assert rgb12[0, :, 5, 5].tolist() == [round(255 * v) for v in (0.2, 0.5, 0.9)]
    assert (grey8 == grey8[:, :, :1, :1]).all()


def test_images_are_resized_by_the_shorter_side_then_centre_cropped() -> None:
    # Prepare: top half black, bottom half white, 64x64
    img = torch.zeros(1, 3, 64, 64)
    img[..., 32:, :] = 1.0

    # Execute: 6x10 = resize to 10x10, keep rows 2..7
    out = to_input_spec(img, 1, 6, 10)

    # Assert: the crop keeps the middle rows, so the boundary sits in the middle
    assert out.shape == (1, 1, 6, 10)
    assert (out[0, 0, 0] == 0).all() and (out[0, 0, -1] == 255).all()
    assert (np.diff(out[0, 0, :, 0].astype(int)) >= 0).all()
