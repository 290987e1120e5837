"""FedVTC's loss terms against hand-computed values (spec §3)."""

import math

import torch

from edge_agent.algorithms.fedvtc import tc_losses


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
