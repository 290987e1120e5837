"""Velo's server-side conditional VAE over features (felo_velo.md §5.2).

Layer layout of the authors' ``ServerModel``: a label embedding shared by encoder and decoder;
encoder ``[s, E(y)] -> Linear(d_f+e, hidden) -> BatchNorm1d -> ReLU -> Linear(hidden, 2·z)``
split into μ and log σ²; decoder ``[z, E(y)] -> Linear(z+e, hidden) -> Linear(hidden, d_f)``
with no activation at all (as in the code). Paper sizes: ``z_dim = 1024``, ``embed_dim = 512``,
``hidden = 1024``; the toy reproduction uses 16 / 16 / 64.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from protocol.errors import ConfigError

__all__ = ["CVAE"]


class CVAE(nn.Module):
    """Class-conditional VAE of feature vectors ``s ∈ R^{d_f}``.

    Args:
        feature_dim: d_f, the federation-wide feature size.
        num_classes: Number of labels (size of the embedding table).
        z_dim: Latent size.
        embed_dim: Label-embedding size.
        hidden: Width of the encoder's and the decoder's hidden layer.
    """

    def __init__(
        self,
        feature_dim: int,
        num_classes: int,
        *,
        z_dim: int = 1024,
        embed_dim: int = 512,
        hidden: int = 1024,
    ) -> None:
        super().__init__()
        sizes = {
            "feature_dim": feature_dim,
            "num_classes": num_classes,
            "z_dim": z_dim,
            "embed_dim": embed_dim,
            "hidden": hidden,
        }
        bad = {k: v for k, v in sizes.items() if v < 1}
        if bad:
            raise ConfigError(f"CVAE sizes must be >= 1, got {bad}")
        self.feature_dim = feature_dim
        self.num_classes = num_classes
        self.z_dim = z_dim
        self.embed = nn.Embedding(num_classes, embed_dim)
        self.encoder = nn.Sequential(
            nn.Linear(feature_dim + embed_dim, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, 2 * z_dim),
        )
        self.decoder = nn.Sequential(
            nn.Linear(z_dim + embed_dim, hidden),
            nn.Linear(hidden, feature_dim),
        )

    def encode(self, features: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """``[B, d_f]``, ``[B]`` -> ``(mu, logvar)``, each ``[B, z_dim]``."""
        stats = self.encoder(torch.cat([features, self.embed(labels)], dim=1))
        mu, logvar = stats.chunk(2, dim=1)
        return mu, logvar

    def decode(self, z: Tensor, labels: Tensor) -> Tensor:
        """``[B, z_dim]``, ``[B]`` -> reconstructed features ``[B, d_f]``."""
        return self.decoder(torch.cat([z, self.embed(labels)], dim=1))  # type: ignore[no-any-return]

    def forward(self, features: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Reconstruction with the reparameterisation trick: ``(recon, mu, logvar)``."""
        mu, logvar = self.encode(features, labels)
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
        return self.decode(z, labels), mu, logvar

    @torch.no_grad()
    def generate(self, labels: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Synthetic features ``[B, d_f]`` for ``labels`` from ``z ~ N(0, I)``.

        Runs in eval mode whatever the current mode is (BatchNorm lives only in the encoder, so
        this changes nothing, but it makes the call independent of training state).
        """
        was_training = self.training
        self.eval()
        try:
            z = torch.randn(labels.shape[0], self.z_dim, generator=generator, device=labels.device)
            return self.decode(z, labels)
        finally:
            self.train(was_training)

    @staticmethod
    def kl_divergence(mu: Tensor, logvar: Tensor) -> Tensor:
        """Per-sample ``KL(N(mu, σ²) ‖ N(0, I))`` summed over latent dims, shape ``[B]``."""
        return -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), dim=1)
