"""FedVTC's loss terms against hand-computed values (spec §3)."""

import math

import pytest
import torch

from edge_agent.algorithms import EdgeContext
from edge_agent.algorithms.fedvtc import FedVTCEdge, tc_losses, tc_terms
from edge_agent.trainer import TensorData
from models import create_model
from protocol.algorithms.fedvtc import FedVTCConfig


def test_reconstruction_kl_and_dm_by_hand() -> None:
    # Prepare: 2 samples, 2 pixels, p = 2; sigma = (1, e) so log sigma = (0, 1)
    x = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    x_gen = torch.tensor([[1.0, 1.0], [0.0, 0.5]])
    z = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    z_gen = torch.tensor([[1.0, 0.0], [3.0, 4.0]])
    protos = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([1.0, 0.0])  # sample 2's class has no global prototype yet
    rho = torch.tensor([0.0, 1.0])
    # Execute
    elbo, dm = tc_losses(x, z, x_gen, z_gen, protos, mask, rho, kl_sigma_weight=1.0)
    # Assert
    sigma_part = 0.5 * ((1 + math.e**2) - 2 - (0 + 2))  # 0.5 (sum s^2 - p - sum log s^2)
    rc = torch.tensor([1.0, 0.25])  # summed squared pixel error
    kl_mean = torch.tensor([0.5 * 4.0, 0.0])  # 0.5 ||z - c||^2, masked for sample 2
    torch.testing.assert_close(elbo, rc + kl_mean + sigma_part)
    torch.testing.assert_close(dm, torch.tensor([0.0, 0.0]))  # sample 1 hits c exactly; 2 masked


def test_sigma_part_is_minimal_at_one_and_weightable() -> None:
    x = z = torch.zeros(1, 3)
    protos, mask = torch.zeros(1, 3), torch.ones(1)
    at_one, _ = tc_losses(x, z, x, None, protos, mask, torch.zeros(3), 1.0)
    away, _ = tc_losses(x, z, x, None, protos, mask, torch.full((3,), -1.0), 1.0)
    off, _ = tc_losses(x, z, x, None, protos, mask, torch.full((3,), -1.0), 0.0)
    assert float(at_one) == 0.0 and float(away) > 0.0 and float(off) == 0.0


def test_distribution_matching_by_hand() -> None:
    # Prepare: DM pulls the re-encoded generated sample to the prototype of the TRUE label
    x = x_gen = torch.zeros(2, 3)
    z = torch.tensor([[1.0, 1.0], [2.0, 0.0]])
    z_gen = torch.tensor([[1.0, 3.0], [0.0, -1.0]])
    protos = torch.tensor([[0.0, 1.0], [2.0, 1.0]])
    mask = torch.ones(2)
    # Execute
    rc, kl, dm = tc_terms(x, z, x_gen, z_gen, protos, mask, torch.zeros(2), kl_sigma_weight=1.0)
    # Assert
    torch.testing.assert_close(rc, torch.zeros(2))
    torch.testing.assert_close(kl, torch.tensor([0.5 * 1.0, 0.5 * 1.0]))  # sigma = 1: no SD part
    torch.testing.assert_close(dm, torch.tensor([1.0 + 4.0, 4.0 + 4.0]))  # summed over p


def make_edge(labels: list[int], **cfg: object) -> FedVTCEdge:
    """A 4-class client with the given training labels and the 8x8 toy VTC (p = 64)."""
    y = torch.tensor(labels)
    x = torch.rand(len(y), 1, 8, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    net = create_model("mlp_s", num_classes=4, in_chans=1, feature_dim=64, input_size=8)
    edge = FedVTCEdge(
        EdgeContext(
            model=net,
            train=TensorData(x, y),
            test=TensorData(x, y),
            num_classes=4,
            device=torch.device("cpu"),
            generator=torch.Generator().manual_seed(0),
        )
    )
    edge.cfg = FedVTCConfig().replace(**cfg)
    return edge


def test_class_balanced_reduction_by_hand() -> None:
    # Prepare: 6 samples of class 0, 2 of class 2 -> w_0 = 8/6, w_2 = 8/2 (spec §8-D4)
    edge = make_edge([0] * 6 + [2] * 2)
    assert edge.class_weight.tolist() == pytest.approx([8 / 6, 0.0, 4.0, 0.0])
    y = torch.tensor([0, 0, 2])
    loss = torch.tensor([1.0, 2.0, 4.0])
    w = edge.class_weight[y]
    # Execute / Assert: batch mean of w_i * l_i, the unbiased estimate of sum_y mean_{D^y} l
    assert float(edge._reduce(loss, y, w)) == pytest.approx((8 / 6 * 1 + 8 / 6 * 2 + 4 * 4) / 3)
    edge.cfg = edge.config.replace(tc_reduction="classsum_batch")
    assert float(edge._reduce(loss, y, w)) == pytest.approx(1.5 + 4.0)  # class means, summed
    edge.cfg = edge.config.replace(tc_reduction="mean")
    assert float(edge._reduce(loss, y, w)) == pytest.approx(7 / 3)


def test_tc_combines_terms_with_lambda_and_per_dim_scale() -> None:
    # Prepare: _tc must equal reduce(rc + kl + lambda * dm) on the same latent noise
    edge = make_edge([0] * 4 + [2] * 4, dm_weight=0.1)
    edge.valid[:] = True
    edge.table = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    x, y = edge.ctx.train.x, edge.ctx.train.y
    edge.generator.eval()
    with torch.no_grad():
        z = edge.ctx.model.forward_features(x)

        def terms() -> tuple[torch.Tensor, ...]:
            edge.noise.manual_seed(3)
            eps = torch.randn(z.shape, generator=edge.noise)
            x_gen = edge.generator(z + edge.rho.exp() * eps)
            return tc_terms(
                x,
                z,
                x_gen,
                edge.ctx.model.forward_features(x_gen),
                edge.table[y],
                torch.ones(len(y)),
                edge.rho,
                1.0,
            )

        def tc() -> float:
            edge.noise.manual_seed(3)
            return float(edge._tc(x, y, z))

        rc, kl, dm = terms()
        w = edge.class_weight[y]  # 2.0 for both classes
        assert tc() == pytest.approx(float((w * (rc + kl + 0.1 * dm)).mean()), rel=1e-5)
        edge.cfg = edge.config.replace(tc_scale="per_dim")
        expect = (w * (rc / 64 + kl / 64 + 0.1 * dm / 64)).mean()  # 64 pixels, p = 64
        assert tc() == pytest.approx(float(expect), rel=1e-5)
        edge.cfg = edge.config.replace(tc_scale="sum", use_dm=False)
        assert tc() == pytest.approx(float((w * (rc + kl)).mean()), rel=1e-5)
