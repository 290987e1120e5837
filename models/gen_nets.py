"""Generator networks that ship with edgefl (no download, CPU-friendly).

* :class:`CPPNGenerator`: a procedural compositional-pattern generator, never trained, fully
  determined by a seed (fedktl.md §9.1 "cppn"). Mapping: ``z(8) -> 64 -> H`` with LeakyReLU, so
  valid latents are a non-trivial push-forward of a Gaussian; synthesis: per pixel,
  ``[x, y, r, w] -> 3-layer tanh MLP -> channels``, renderable at any resolution.
* :class:`DCGANGenerator`: the classic DCGAN generator layout (``ConvTranspose 100->512 4×4``,
  then ``512->256->128->64`` stride 2 with BatchNorm + ReLU, then ``64->3`` + Tanh), whose
  ``main.*`` parameter names match the ``netG_state_dict`` of the ``gan-face-generate`` wheel.

Both follow the generator-module convention of :mod:`models.generators`: attributes ``z_dim``,
``w_dim``, ``img_channels``, ``img_resolution``, ``output_range`` and methods ``mapping(z)`` (may
be absent for a Gaussian latent prior) and ``synthesis(w)``. Both are TorchScript-compatible.
"""

# No ``from __future__ import annotations``: TorchScript needs the class-level ``grid: Tensor``
# annotation as a real type, not a string.
import math

import torch
from torch import Tensor, nn

from models.seeding import blank
from protocol.errors import ConfigError

__all__ = ["CPPNGenerator", "DCGANGenerator"]


class CPPNGenerator(nn.Module):
    """Untrained procedural generator, deterministic from ``seed`` (< 10 k parameters).

    Args:
        w_dim: Latent size H.
        img_channels: Output channels.
        img_resolution: Output side length (any value works; it only sets the default grid).
        z_dim: Noise size of the mapping network.
        hidden: Width of the synthesis MLP.
        seed: Seed of the weights (drawn from a private ``torch.Generator``, so the global RNG
            is left alone).
    """

    grid: Tensor

    def __init__(
        self,
        w_dim: int = 16,
        img_channels: int = 1,
        img_resolution: int = 8,
        *,
        z_dim: int = 8,
        hidden: int = 32,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if min(w_dim, img_channels, img_resolution, z_dim, hidden) < 1:
            raise ConfigError("CPPNGenerator sizes must be >= 1")
        self.z_dim = z_dim
        self.w_dim = w_dim
        self.img_channels = img_channels
        self.img_resolution = img_resolution
        self.output_range = (-1.0, 1.0)
        # built blank: the layers' own init would draw from the global generator; the
        # weights are drawn from `seed`'s private one below
        self.map_net = blank(lambda: nn.Sequential(
            nn.Linear(z_dim, 64), nn.LeakyReLU(0.2), nn.Linear(64, w_dim), nn.LeakyReLU(0.2)
        ))  # fmt: skip
        self.pix_net = blank(lambda: nn.Sequential(
            nn.Linear(3 + w_dim, hidden), nn.Tanh(),
            nn.Linear(hidden, hidden), nn.Tanh(),
            nn.Linear(hidden, img_channels), nn.Tanh(),
        ))  # fmt: skip
        rng = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                fan_in = p.shape[1] if p.dim() == 2 else 1
                # Gain 2 keeps the tanh MLP out of its linear regime: visible patterns.
                p.copy_(torch.randn(p.shape, generator=rng) * 2.0 / math.sqrt(fan_in))
        side = torch.linspace(-1.0, 1.0, img_resolution)
        ys, xs = torch.meshgrid(side, side, indexing="ij")
        grid = torch.stack([xs, ys, torch.sqrt(xs * xs + ys * ys)], dim=-1)  # [R, R, 3]
        self.register_buffer("grid", grid, persistent=False)

    @torch.jit.export
    def mapping(self, z: Tensor) -> Tensor:
        """Noise ``[n, z_dim]`` -> latents ``[n, w_dim]``."""
        return self.map_net(z)  # type: ignore[no-any-return]

    @torch.jit.export
    def synthesis(self, w: Tensor) -> Tensor:
        """Latents ``[n, w_dim]`` -> images ``[n, C, R, R]`` in [-1, 1]."""
        n = w.shape[0]
        r = self.grid.shape[0]
        coords = self.grid.unsqueeze(0).expand(n, r, r, 3)
        latent = w[:, None, None, :].expand(n, r, r, w.shape[1])
        pixels: Tensor = self.pix_net(torch.cat([coords, latent], dim=-1))  # [n, R, R, C]
        return pixels.permute(0, 3, 1, 2).contiguous()

    def forward(self, z: Tensor) -> Tensor:
        """``synthesis(mapping(z))``."""
        return self.synthesis(self.mapping(z))


class DCGANGenerator(nn.Module):
    """DCGAN generator: ``z [n, nz]`` -> images ``[n, nc, 64, 64]`` in [-1, 1].

    The latent prior is Gaussian (no mapping network), so ``w = z``.

    Args:
        nz: Latent size.
        ngf: Base width (64 in the classic layout: widths 512/256/128/64).
        nc: Output channels.
    """

    def __init__(self, nz: int = 100, ngf: int = 64, nc: int = 3) -> None:
        super().__init__()
        self.z_dim = nz
        self.w_dim = nz
        self.img_channels = nc
        self.img_resolution = 64
        self.output_range = (-1.0, 1.0)
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 8), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 4), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),
            nn.Tanh(),
        )  # fmt: skip

    @torch.jit.export
    def synthesis(self, w: Tensor) -> Tensor:
        """Latents ``[n, nz]`` -> images ``[n, nc, 64, 64]`` in [-1, 1]."""
        return self.main(w.reshape(w.shape[0], w.shape[1], 1, 1))  # type: ignore[no-any-return]

    def forward(self, z: Tensor) -> Tensor:
        """``synthesis(z)``."""
        return self.synthesis(z)
