"""FedKTL's networks (fedktl.md §5): the ETF classifier, the cosine/ArcFace head, the server's
feature transformer F and the client's extra projection h'.

The client model is ``f -> h -> L2-normalise -> cosine with the ETF columns``: ``f`` is any
registered :class:`~models.Classifier`'s ``forward_features`` (with ``feature_dim = K'``) and
:class:`ETFHead` holds ``h = Linear(K', K)`` and the frozen ETF, so attaching it as the
classifier's head (:func:`attach_etf_head`) gives a model whose ``forward`` returns the
inference cosines and which exports to ONNX unchanged (§9.2).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models._classifier import Classifier
from protocol.errors import ConfigError

__all__ = [
    "ETFHead",
    "FeatureTransformer",
    "arcface_logits",
    "attach_etf_head",
    "etf_matrix",
    "latent_projection",
    "median_bandwidths",
    "mmd2_rbf",
    "rbf_kernel",
]

#: The authors' RBF bandwidths for the MMD (fedktl.md §4.4): ``a`` in ``exp(-d² / (2a))``.
MMD_BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)

_COS_EPS = 1e-7  # acos has an infinite gradient at ±1 (§9 item 14)


def etf_matrix(
    num_classes: int,
    etf_dim: int | None = None,
    *,
    generator: torch.Generator | None = None,
    max_tries: int = 10,
) -> Tensor:
    """A simplex ETF ``V = sqrt(C/(C-1)) · U (I - 11ᵀ/C)`` of shape ``[K, C]``, float32.

    ``U`` is the reduced QR factor of a uniform [0, 1) ``K×C`` matrix (the authors' recipe),
    redrawn if its columns are not orthonormal to 1e-6. Columns of ``V`` have unit norm and
    pairwise cosine ``-1/(C-1)``.

    Args:
        num_classes: C >= 2.
        etf_dim: K, defaults to C.
        generator: Seeded torch RNG; draw once on the server and broadcast V.
        max_tries: QR redraws before giving up.

    Raises:
        ConfigError: ``K < C`` (no orthonormal K×C U exists; the paper's K >= C-1 is not
            enough) or C < 2.
    """
    c = num_classes
    k = c if etf_dim is None else etf_dim
    if c < 2:
        raise ConfigError(f"etf: num_classes must be >= 2, got {c}")
    if k < c:
        raise ConfigError(
            f"etf: etf_dim K={k} < num_classes C={c}; FedKTL needs K >= C for an orthonormal "
            "K×C basis (set etf_dim >= num_classes)"
        )
    eye = torch.eye(c, dtype=torch.float64)
    for _ in range(max_tries):
        u, _r = torch.linalg.qr(torch.rand(k, c, generator=generator, dtype=torch.float64))
        if torch.allclose(u.T @ u, eye, atol=1e-6):
            break
    else:
        raise ConfigError(f"etf: no orthonormal basis after {max_tries} draws")
    centred = eye - torch.full((c, c), 1.0 / c, dtype=torch.float64)
    etf: Tensor = math.sqrt(c / (c - 1)) * u @ centred
    return etf.float()


def arcface_logits(cos: Tensor, labels: Tensor, scale: float = 64.0, margin: float = 0.5) -> Tensor:
    """``s · cos(θ_y + m)`` for the true class and ``s · cos θ_c`` elsewhere (§4.1).

    No "easy margin" threshold, as in the paper; ``cos`` is clamped away from ±1 first.
    """
    cos = cos.clamp(-1.0 + _COS_EPS, 1.0 - _COS_EPS)
    target = torch.cos(torch.acos(cos) + margin)
    onehot = F.one_hot(labels, cos.shape[1]).bool()
    return scale * torch.where(onehot, target, cos)


class ETFHead(nn.Module):
    """``h = Linear(K', K)`` followed by the cosine against the frozen ETF columns.

    ``forward(features)`` returns the cosines ``[B, C]`` (inference: argmax, no scale/margin);
    :meth:`embed` gives ``h(f(x))`` for prototypes; :meth:`arcface` gives training logits.

    Args:
        in_features: K', the extractor's feature size.
        etf: ``V`` of shape ``[K, C]`` from :func:`etf_matrix`.
        scale: ArcFace scale s.
        margin: ArcFace additive angular margin m.
    """

    etf_t: Tensor

    def __init__(
        self, in_features: int, etf: Tensor, *, scale: float = 64.0, margin: float = 0.5
    ) -> None:
        super().__init__()
        if etf.dim() != 2:
            raise ConfigError(f"etf: expected a [K, C] matrix, got shape {tuple(etf.shape)}")
        k, c = etf.shape
        self.proj = nn.Linear(in_features, k)
        self.scale = scale
        self.margin = margin
        self.num_classes = c
        # Ṽ = rownormalise(Vᵀ) ∈ [C, K]; persistent so checkpoints and exports carry it.
        self.register_buffer("etf_t", F.normalize(etf.detach().float().T, dim=1))

    def embed(self, features: Tensor) -> Tensor:
        """``[B, K']`` -> ETF-space embedding ``h(features)`` ``[B, K]`` (not normalised)."""
        return self.proj(features)  # type: ignore[no-any-return]

    def cosine(self, embedding: Tensor) -> Tensor:
        """``[B, K]`` -> cosine with every class vector ``[B, C]``."""
        return F.normalize(embedding, dim=1) @ self.etf_t.T

    def forward(self, features: Tensor) -> Tensor:
        """``[B, K']`` -> cosines ``[B, C]``."""
        return self.cosine(self.embed(features))

    def arcface(self, features: Tensor, labels: Tensor) -> Tensor:
        """Training logits ``[B, C]`` with the margin on the true class."""
        return arcface_logits(self(features), labels, self.scale, self.margin)


def attach_etf_head(
    model: Classifier, etf: Tensor, *, scale: float = 64.0, margin: float = 0.5
) -> ETFHead:
    """Replace ``model``'s head by an :class:`ETFHead` on its ``num_features`` and return it."""
    head = ETFHead(model.num_features, etf, scale=scale, margin=margin)
    device = next(model.parameters()).device
    model.head = head.to(device)
    model.num_classes = head.num_classes
    return head


class FeatureTransformer(nn.Module):
    """Server-side F: ``Linear(K, hidden) -> BatchNorm1d -> ReLU -> Linear(hidden, H)`` (§5.3).

    Args:
        in_dim: K (or K' in the −ETF ablation: the prototype size).
        out_dim: H, the generator's latent size.
        hidden: Hidden width; the authors use K.
    """

    def __init__(self, in_dim: int, out_dim: int, hidden: int | None = None) -> None:
        super().__init__()
        width = in_dim if hidden is None else hidden
        self.net = nn.Sequential(
            nn.Linear(in_dim, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, out_dim)
        )

    def forward(self, prototypes: Tensor) -> Tensor:
        """``[n, K]`` -> latents ``[n, H]``."""
        return self.net(prototypes)  # type: ignore[no-any-return]


def latent_projection(feature_dim: int, latent_dim: int) -> nn.Linear:
    """The client's extra layer ``h' = Linear(K', H)`` with bias, used only for ``L^M``.

    Initialised from torch's global RNG: the server creates it once and ships the weights
    (§3.0), because seeds are not bit-stable across torch builds.
    """
    return nn.Linear(feature_dim, latent_dim)


def rbf_kernel(a: Tensor, b: Tensor, bandwidths: tuple[float, ...] = MMD_BANDWIDTHS) -> Tensor:
    """``[n, m]`` sum over ``bandwidths`` of ``exp(-0.5 * |a_i - b_j|² / bw)`` (``bw`` plays
    the role of sigma²)."""
    # expanded |a|² + |b|² - 2ab rather than cdist: finite gradients at zero distance
    d = ((a * a).sum(1, keepdim=True) + (b * b).sum(1) - 2.0 * a @ b.T).clamp_min(0.0)
    return sum((torch.exp(-0.5 * d / bw) for bw in bandwidths), torch.zeros_like(d))


def mmd2_rbf(
    x: Tensor,
    y: Tensor,
    bandwidths: tuple[float, ...] = MMD_BANDWIDTHS,
    x_weights: Tensor | None = None,
) -> Tensor:
    """Biased (V-statistic) squared MMD between samples ``x`` and ``y`` ``[n, H]`` (§4.4):
    kernel means over all pairs, diagonals included, as in the authors' ``MMD(x, y, 'rbf')``.
    ``x_weights`` ``[n]``: ``x`` as a weighted sample (each row's share of its kernel means is
    its weight over their sum)."""
    if x_weights is None:
        xy = rbf_kernel(x, y, bandwidths).mean()
        xx = rbf_kernel(x, x, bandwidths).mean()
    else:
        a = x_weights / x_weights.sum()
        xy = (a @ rbf_kernel(x, y, bandwidths)).mean()
        xx = a @ rbf_kernel(x, x, bandwidths) @ a
    return xx + rbf_kernel(y, y, bandwidths).mean() - 2.0 * xy


@torch.no_grad()
def median_bandwidths(
    x: Tensor, y: Tensor, factors: tuple[float, ...] = (0.5, 1, 2, 4)
) -> tuple[float, ...]:
    """Bandwidths for :func:`mmd2_rbf` scaled to the data: ``factors`` times half the median
    squared distance of the pooled sample (so ``exp(-0.5 d²/a)`` is ``e^-1`` at the median for
    factor 1). For latents whose scale makes the fixed {10, 15, 20, 50} vanish (H = 100:
    ``d² ≈ 200``) — fedktl.md §9 item 5."""
    z = torch.cat([x, y]).detach().float()
    d = torch.cdist(z, z).pow(2)
    off = d[~torch.eye(len(z), dtype=torch.bool, device=d.device)]
    med = float(off.median()) if off.numel() else 1.0
    return tuple(max(f * med / 2.0, 1e-6) for f in factors)
