"""Velo's server-side CVAE: continue training on the kept features, sample one per class.

Imported lazily by :class:`coordinator.strategies.felo.strategy.VeloStrategy` (torch is only loaded
on
the server's training path). Training goes through the one server fit loop
(:func:`models.fit.fit`), with the run's seeded generator driving batch order and the
reparameterisation noise, so a resumed step replays the same CVAE exactly.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from coordinator.aggregation import screen_by_class
from coordinator.strategies.base import ServerContext
from coordinator.strategies.felo.table import KnowledgeTable
from models import CVAE
from models.fit import fit, resumed
from models.tensormap import module_to_tensormap
from protocol.algorithms.felo import VeloConfig
from protocol.contract.payloads import PrototypeSet, TensorMap

__all__ = ["cvae_loss_fn", "train_and_sample"]


def cvae_loss_fn(kind: str) -> Any:
    """The loss of §8-D6: ``code`` (mean MSE + KL summed over batch and latent dims) or
    ``elbo`` (per-sample summed squared error + KL, mean over the batch)."""

    def loss(
        module: nn.Module, batch: tuple[Tensor, ...], gen: torch.Generator
    ) -> dict[str, Tensor]:
        s, y = batch
        cvae = cast(CVAE, module)
        mu, logvar = cvae.encode(s, y)
        eps = torch.randn(mu.shape, generator=gen).to(mu.device)
        recon = cvae.decode(mu + torch.exp(0.5 * logvar) * eps, y)
        kl = CVAE.kl_divergence(mu, logvar)  # [B]
        if kind == "code":
            rec, kl_term = F.mse_loss(recon, s), kl.sum()
        else:
            rec, kl_term = (recon - s).pow(2).sum(dim=1).mean(), kl.mean()
        return {
            "loss": rec + kl_term,
            "recon_mse": F.mse_loss(recon.detach(), s),
            "kl_per_dim": kl.detach().mean() / cvae.z_dim,  # near 0 = posterior collapse
        }

    return loss


def _build(
    cfg: VeloConfig,
    feature_dim: int,
    num_classes: int,
    state: TensorMap | None,
    gen: torch.Generator,
) -> CVAE:
    return resumed(
        lambda: CVAE(
            feature_dim,
            num_classes,
            z_dim=cfg.cvae_z_dim,
            embed_dim=cfg.cvae_embed_dim,
            hidden=cfg.cvae_hidden,
        ),
        state,
        gen,
        "velo cvae state",
    )


def train_and_sample(
    state: TensorMap | None, table: KnowledgeTable, cfg: VeloConfig, ctx: ServerContext
) -> tuple[TensorMap, PrototypeSet, dict[str, float]]:
    """Continue training the persistent CVAE (fresh Adam) on the table's features (less the
    outliers ``upload_screen`` screens), then draw ``z ~ N(0, I)`` once per class present in
    the table."""
    dim = table.feature_dim
    if dim is None:
        raise ValueError("no features to train the CVAE on")
    gen = ctx.torch_generator()
    device = torch.device(ctx.device)
    cvae = _build(cfg, dim, table.num_classes, state, gen)
    # the table's entries are individual uploads: upload_screen leaves a class's outliers out
    keep = screen_by_class(table.cls, table.features, cfg.upload_screen)
    feats = torch.as_tensor(table.features[keep], dtype=torch.float32)
    labels = torch.as_tensor(table.cls[keep], dtype=torch.long)
    stats = fit(
        cvae,
        (feats, labels),
        cvae_loss_fn(cfg.cvae_loss),
        epochs=cfg.cvae_epochs,
        batch_size=cfg.cvae_batch_size,
        lr=cfg.cvae_lr,
        generator=gen,
        device=device,
    )
    classes = torch.as_tensor(np.unique(table.cls), dtype=torch.long)
    cvae.eval()
    with torch.no_grad():
        z = torch.randn(classes.numel(), cfg.cvae_z_dim, generator=gen).to(device)
        samples = cvae.decode(z, classes.to(device)).cpu().numpy()
    weights = module_to_tensormap(cvae)
    synthetic = PrototypeSet(classes.numpy(), samples, np.ones(classes.numel(), np.int32))
    metrics = {f"cvae_{k}": v for k, v in stats.terms.items()}
    metrics["cvae_steps"] = float(stats.steps)
    metrics["cvae_entries"] = float(keep.sum())  # what it trained on
    metrics["cvae_s"] = stats.seconds
    if cfg.upload_screen > 0:
        metrics["screened_uploads"] = float((~keep).sum())
    return weights, synthetic, metrics
