"""FedVTC's variational transposed-convolution generator ψ (fedvtc.md §5.1, Table 6).

The latent ``v ∈ R^p`` is reshaped row-major to ``(C0, H/4, W/4)`` and goes through four
blocks, each ``ConvTranspose2d -> BatchNorm2d -> activation``:

==== ======================= ============== ===================
blk  op                      out channels   activation
==== ======================= ============== ===================
1    ConvT(k3, s1, p1)       c1             LeakyReLU(0.01)
2    ConvT(k4, s2, p1)       c2             LeakyReLU(0.01)
3    ConvT(k3, s1, p1)       c2             LeakyReLU(0.01)
4    ConvT(k4, s2, p1)       out_chans      Sigmoid (after BN)
==== ======================= ============== ===================

Paper configurations: 28×28×1 with p = 980 (20×7×7, widths 16/32), 32×32×3 with p = 4096
(64×8×8, widths 32/64), 64×64×3 with p = 32768 (128×16×16, widths 64/64; §8-D9), and the toy
8×8×1 one of §10.1 with p = 64 (16×2×2, widths 16/32). :func:`vtc_widths` reproduces all four
from ``C0``. Bias stays at PyTorch's default (on) and BatchNorm at default eps/momentum, so two
generators of one configuration have identical state-dict keys and can be averaged, buffers
included (§8-D11).
"""

from __future__ import annotations

from torch import Tensor, nn

from protocol.errors import ConfigError

__all__ = ["VTCGenerator", "vtc_for", "vtc_widths"]

_LEAK = 0.01


def vtc_widths(c0: int) -> tuple[int, int]:
    """Channel widths ``(c1, c2)`` for a latent of ``c0`` channels.

    ``c1 = clamp(c0 // 2, 16, 64)`` and ``c2 = min(2·c1, 64)`` give exactly the paper's widths
    (20 -> 16/32, 64 -> 32/64, 128 -> 64/64) and the toy 8×8 one (16 -> 16/32).
    """
    c1 = min(max(c0 // 2, 16), 64)
    return c1, min(2 * c1, 64)


def _block(cin: int, cout: int, k: int, s: int, act: nn.Module) -> nn.Sequential:
    return nn.Sequential(
        nn.ConvTranspose2d(cin, cout, k, stride=s, padding=1), nn.BatchNorm2d(cout), act
    )


class VTCGenerator(nn.Module):
    """Latent ``[B, p]`` -> images ``[B, out_chans, H, W]`` in (0, 1).

    Args:
        latent_dim: p; must equal ``C0·(H/4)·(W/4)`` for an integer ``C0``.
        out_chans: Image channels.
        out_size: Side length or ``(H, W)``; both divisible by 4.
        widths: ``(c1, c2)``; defaults to :func:`vtc_widths` of ``C0``.

    Raises:
        ConfigError: When the sizes do not fit the reshape rule.
    """

    def __init__(
        self,
        latent_dim: int,
        out_chans: int,
        out_size: int | tuple[int, int],
        widths: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        h, w = (out_size, out_size) if isinstance(out_size, int) else out_size
        if h < 4 or w < 4 or h % 4 or w % 4:
            raise ConfigError(f"VTC out_size: H and W must be multiples of 4, got {(h, w)}")
        if out_chans < 1:
            raise ConfigError(f"VTC out_chans: expected >= 1, got {out_chans}")
        cells = (h // 4) * (w // 4)
        if latent_dim < 1 or latent_dim % cells:
            raise ConfigError(
                f"VTC latent_dim: must be C0·{h // 4}·{w // 4} for an integer C0 "
                f"(rule C0·(H/4)·(W/4) = p), got {latent_dim}"
            )
        self.latent_dim = latent_dim
        self.out_chans = out_chans
        self.out_size = (h, w)
        self.latent_shape = (latent_dim // cells, h // 4, w // 4)
        c1, c2 = vtc_widths(self.latent_shape[0]) if widths is None else widths
        self.widths = (c1, c2)
        self.blocks = nn.Sequential(
            _block(self.latent_shape[0], c1, 3, 1, nn.LeakyReLU(_LEAK)),
            _block(c1, c2, 4, 2, nn.LeakyReLU(_LEAK)),
            _block(c2, c2, 3, 1, nn.LeakyReLU(_LEAK)),
            _block(c2, out_chans, 4, 2, nn.Sigmoid()),
        )

    def forward(self, v: Tensor) -> Tensor:
        """``v [B, p]`` -> images ``[B, out_chans, H, W]`` in (0, 1)."""
        return self.blocks(v.reshape(v.shape[0], *self.latent_shape))  # type: ignore[no-any-return]


def vtc_for(latent_dim: int, in_chans: int, image_size: int | tuple[int, int]) -> VTCGenerator:
    """The VTC generator for images of ``in_chans`` channels and ``image_size``.

    Widths follow :func:`vtc_widths`, which matches every configuration in the spec.
    """
    return VTCGenerator(latent_dim, in_chans, image_size)
