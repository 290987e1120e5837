"""Velo's two CVAE losses (spec §8-D6) against the formulas, with the same noise draw."""

import pytest
import torch

from coordinator.strategies.felo.cvae import cvae_loss_fn
from models import CVAE


def test_code_and_elbo_losses_match_their_formulas() -> None:
    torch.manual_seed(0)
    cvae = CVAE(4, 3, z_dim=2, embed_dim=2, hidden=5)
    s, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    for kind in ("code", "elbo"):
        # Prepare: the same eps the loss draws
        eps = torch.randn(6, 2, generator=torch.Generator().manual_seed(3))
        mu, logvar = cvae.encode(s, y)
        recon = cvae.decode(mu + torch.exp(0.5 * logvar) * eps, y)
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(dim=1)
        if kind == "code":  # mean squared error over elements + KL summed over batch and dims
            expected = ((recon - s) ** 2).mean() + kl.sum()
        else:  # per-sample summed squared error + KL, both averaged over the batch
            expected = ((recon - s) ** 2).sum(dim=1).mean() + kl.mean()
        # Execute
        terms = cvae_loss_fn(kind)(cvae, (s, y), torch.Generator().manual_seed(3))
        # Assert
        assert terms["loss"].item() == pytest.approx(expected.item(), rel=1e-5)
        assert terms["kl_per_dim"].item() == pytest.approx(kl.mean().item() / 2, rel=1e-5)
