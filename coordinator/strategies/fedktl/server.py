"""FedKTL's server work (fedktl.md §3.0, §3.4, §9.1): generator, set-up, alignment, pairs.

Imported lazily by :class:`coordinator.strategies.fedktl.strategy.FedKTLStrategy`, so torch is
loaded
only on the coordinator of a FedKTL run. The feature transformer F and the class-centroid table
train together through the one server fit loop (:func:`models.fit.fit`), the run's seeded
generator driving batch order and the valid-latent samples, so a resumed step replays exactly.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import cast

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from coordinator.strategies.base import ServerContext
from models.fit import LossFn, fit, row_weights
from models.generators import (
    Generator,
    GeneratorError,
    adapt_images,
    bundled,
    load_entry_point,
    load_onnx,
    load_torchscript,
)
from models.ktl import (
    MMD_BANDWIDTHS,
    FeatureTransformer,
    etf_matrix,
    median_bandwidths,
    mmd2_rbf,
    rbf_kernel,
)
from models.seeding import blank
from protocol.algorithms.fedktl import FedKTLConfig
from protocol.contract.payloads import TensorMap
from protocol.errors import AggregationError

__all__ = [
    "VALID_KEY",
    "align",
    "deranged_rows",
    "generator_identity",
    "load_generator",
    "make_setup",
    "matched_noise",
    "random_latents",
    "synthesize",
    "to_input_spec",
]

VALID_KEY = "centroid_valid"  # [C] bool: classes whose centroid was synced at least once


# ----- the generator ------------------------------------------------------------------------
def _path(cfg: FedKTLConfig) -> Path:
    if not cfg.generator_path:
        raise GeneratorError(f"generator = {cfg.generator!r} needs generator_path (a local file)")
    return Path(cfg.generator_path)


def load_generator(cfg: FedKTLConfig) -> Generator:
    """The configured generator, validated (shapes, finite images) by its loader.

    Raises:
        GeneratorError: Missing file or wheel, malformed file, non-finite or out-of-range
            images, or a latent size different from a non-zero ``latent_dim``.
    """
    if cfg.generator == "dcgan_face":
        gen = bundled("dcgan_face")
    elif cfg.generator == "cppn":
        gen = bundled(
            "cppn",
            w_dim=cfg.cppn_w_dim,
            img_channels=cfg.cppn_channels,
            img_resolution=cfg.cppn_resolution,
            seed=cfg.cppn_seed,
        )
    elif cfg.generator == "torchscript":
        gen = load_torchscript(_path(cfg))
    elif cfg.generator == "onnx":
        gen = load_onnx(_path(cfg))
    else:
        weights = _path(cfg) if cfg.generator_path else None
        gen = load_entry_point(
            cfg.generator_entry, weights, state_key=cfg.generator_state_key or None
        )
    if cfg.latent_dim and gen.w_dim != cfg.latent_dim:
        raise GeneratorError(
            f"generator {cfg.generator!r}: latent size w_dim = {gen.w_dim}, but the run's "
            f"latent_dim is {cfg.latent_dim} (set latent_dim = 0 to take the generator's)"
        )
    return gen


def generator_identity(gen: Generator) -> str:
    """SHA-256 naming the generator: its file's hash (one file), a hash of its files' hashes
    (several), or of its weights and sizes (a bundled procedural one without file)."""
    if len(gen.files) == 1:
        return next(iter(gen.files.values()))
    h = hashlib.sha256()
    if gen.files:
        for digest in sorted(gen.files.values()):
            h.update(digest.encode())
    elif gen.module is not None:
        for name, t in sorted(gen.module.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
    else:
        raise GeneratorError("generator has neither files nor a module: no identity to record")
    h.update(f"{gen.z_dim}:{gen.w_dim}:{gen.img_channels}:{gen.img_resolution}".encode())
    return h.hexdigest()


# ----- the set-up (§3.0) --------------------------------------------------------------------
def make_setup(
    num_classes: int, etf_dim: int, feature_dim: int, latent_dim: int, seed: int
) -> dict[str, npt.NDArray[np.float32]]:
    """The ETF ``[K, C]`` and h' = ``Linear(K', H)`` initial weights, drawn from ``seed`` only
    (torch's default Linear distribution U(+-1/sqrt(K')), not the process-global RNG)."""
    gen = torch.Generator().manual_seed(seed)
    etf = etf_matrix(num_classes, etf_dim, generator=gen)  # ConfigError when K < C
    bound = 1.0 / math.sqrt(feature_dim)
    weight = (torch.rand(latent_dim, feature_dim, generator=gen) * 2 - 1) * bound
    bias = (torch.rand(latent_dim, generator=gen) * 2 - 1) * bound
    return {"etf": etf.numpy(), "proj.weight": weight.numpy(), "proj.bias": bias.numpy()}


# ----- alignment of F and the centroids (§3.4, §4.4) ----------------------------------------
class Aligner(nn.Module):
    """F and the learnable class-centroid table ``Cent`` (the authors' ``nn.Embedding``)."""

    def __init__(self, etf_dim: int, latent_dim: int, num_classes: int) -> None:
        super().__init__()
        self.transformer = FeatureTransformer(etf_dim, latent_dim)
        self.centroids = nn.Embedding(num_classes, latent_dim)

    def transform(self, protos: Tensor) -> Tensor:
        """F in train mode; a single prototype passes BatchNorm with its running statistics
        (train-mode BatchNorm cannot normalise one sample; the authors drop such a batch)."""
        if protos.shape[0] > 1:
            return cast(Tensor, self.transformer(protos))
        self.transformer.eval()
        try:
            return cast(Tensor, self.transformer(protos))
        finally:
            self.transformer.train()


@torch.no_grad()
def _init_from(module: nn.Module, gen: torch.Generator) -> None:
    """PyTorch's default distributions drawn from ``gen`` (the coordinator may share its process
    with simulated agents, whose seeded inits must not see its draws): Linear U(+-1/sqrt(fan_in)),
    Embedding N(0, 1) (the authors' centroid init), BatchNorm (1, 0)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            bound = 1.0 / math.sqrt(m.in_features)
            m.weight.copy_((torch.rand(m.weight.shape, generator=gen) * 2 - 1) * bound)
            if m.bias is not None:
                m.bias.copy_((torch.rand(m.bias.shape, generator=gen) * 2 - 1) * bound)
        elif isinstance(m, nn.Embedding):
            m.weight.copy_(torch.randn(m.weight.shape, generator=gen))


def _build(
    state: TensorMap | None, dims: tuple[int, int, int], gen: torch.Generator
) -> tuple[Aligner, Tensor]:
    aligner = blank(lambda: Aligner(*dims))
    if state is None:
        _init_from(aligner, gen)
        return aligner, torch.zeros(dims[2], dtype=torch.bool)
    own = aligner.state_dict()
    aligner.load_state_dict(
        {k: torch.as_tensor(state.tensors[k]).to(v.dtype).reshape(v.shape) for k, v in own.items()}
    )
    return aligner, torch.as_tensor(state.tensors[VALID_KEY]).bool().clone()


@torch.no_grad()
def _sync(
    aligner: Aligner, protos: Tensor, labels: Tensor, valid: Tensor, weights: Tensor | None
) -> None:
    """``Cent[c] = mean F_eval(P)`` over this round's prototypes of every present class
    (weighted by ``weights`` when given); other rows keep their value (classes nobody reported
    this round keep a stale centroid)."""
    aligner.transformer.eval()
    q = aligner.transformer(protos)
    aligner.transformer.train()
    c = valid.numel()
    w = torch.ones(len(labels), device=q.device) if weights is None else weights.to(q.device)
    sums = torch.zeros(c, q.shape[1], device=q.device).index_add_(0, labels, q * w[:, None])
    total = torch.zeros(c, device=q.device).index_add_(0, labels, w)
    present = torch.bincount(labels, minlength=c) > 0
    aligner.centroids.weight[present] = sums[present] / total[present].unsqueeze(1)
    valid |= present.cpu()


def _loss(gen: Generator, cfg: FedKTLConfig) -> LossFn:
    """``MMD(F(P), W) + lambda * MSE(F(P), Cent[y])`` with fresh valid latents W per batch
    (``mmd_weight`` scales the MMD: 0 is the "-L^MMD" ablation). A batch of three tensors
    carries each prototype's weight (mean 1 over the round's prototypes): F(P) is then a
    weighted sample in the MMD and each prototype's squared error is scaled by its weight."""

    def loss(
        module: nn.Module, batch: tuple[Tensor, ...], rng: torch.Generator
    ) -> dict[str, Tensor]:
        aligner = cast(Aligner, module)
        protos, labels, *weight = batch
        q = aligner.transform(protos)
        w = gen.sample_w(q.shape[0], rng).to(q.device)  # no grad: the generator is frozen
        bws = MMD_BANDWIDTHS if cfg.mmd_bandwidth == "fixed" else median_bandwidths(q, w)
        if weight:
            mmd = mmd2_rbf(q, w, bws, x_weights=weight[0])
            err = (q - aligner.centroids(labels)).pow(2).mean(dim=1)
            mse = (err * weight[0]).mean()  # weights of mean 1 over the round
        else:
            mmd = mmd2_rbf(q, w, bws)
            mse = F.mse_loss(q, aligner.centroids(labels))
        return {
            "loss": cfg.mmd_weight * mmd + cfg.mse_weight * mse,
            "mmd": mmd.detach(),
            "mse": mse.detach(),
            # near 0: the bandwidths are far below the latents' distances (fedktl.md §10)
            "kernel_xy": rbf_kernel(q.detach(), w, bws).mean(),
        }

    return loss


def align(
    state: TensorMap | None,
    protos: npt.NDArray[np.float32],
    labels: npt.NDArray[np.int32],
    *,
    num_classes: int,
    gen: Generator,
    cfg: FedKTLConfig,
    ctx: ServerContext,
    weights: npt.NDArray[np.float64] | None = None,
) -> tuple[TensorMap, dict[str, float]]:
    """One server phase: sync the centroids, train F and Cent (fresh Adam), sync again.

    Args:
        state: The aligner's state from the previous round (None: first round).
        protos: This round's uploads ``[M, K]``, flat over agents.
        labels: Their classes ``[M]``.
        num_classes: C, the rows of the centroid table.
        gen: The frozen generator supplying valid latents.
        cfg: The run's config.
        ctx: Device and seed of this step.
        weights: Each prototype's weight ``[M]`` (its staleness weight in buffered mode) in
            the centroids' means and the training loss; None: all alike.
    """
    rng = ctx.torch_generator()
    aligner, valid = _build(state, (protos.shape[1], gen.w_dim, num_classes), rng)
    p = torch.as_tensor(protos, dtype=torch.float32)
    y = torch.as_tensor(labels, dtype=torch.long)
    pw = row_weights(weights)  # None when all alike: the authors' plain means
    _sync(aligner, p, y, valid, pw)
    metrics: dict[str, float] = {"ktl_prototypes": float(len(p))}
    if len(p) >= 2 and cfg.server_epochs > 0:  # one prototype: nothing to align (authors)
        stats = fit(
            aligner,
            (p, y) if pw is None else (p, y, pw),
            _loss(gen, cfg),
            epochs=cfg.server_epochs,
            batch_size=cfg.server_batch_size,
            lr=cfg.server_lr,
            generator=rng,
            grad_clip=cfg.server_grad_clip,
            device=ctx.device,
        )
        metrics.update({f"ktl_{n}": v for n, v in stats.terms.items()})
        metrics.update(ktl_steps=float(stats.steps), ktl_s=stats.seconds)
        aligner.cpu()
    _sync(aligner, p, y, valid, pw)
    metrics.update(_centroid_spread(aligner.centroids.weight.detach()[valid]))
    tensors = {n: t.detach().cpu().numpy() for n, t in aligner.state_dict().items()}
    tensors[VALID_KEY] = valid.numpy()
    return TensorMap(tensors), metrics


def _centroid_spread(q: Tensor) -> dict[str, float]:
    """Pairwise distances between the valid centroids: class-discriminative when clearly > 0."""
    if q.shape[0] < 2:
        return {"ktl_classes": float(q.shape[0])}
    d = torch.cdist(q, q)[~torch.eye(q.shape[0], dtype=torch.bool)]
    return {
        "ktl_classes": float(q.shape[0]),
        "ktl_centroid_dist_min": float(d.min()),
        "ktl_centroid_dist_mean": float(d.mean()),
    }


# ----- the pairs (§3.1, §9 item 12) ---------------------------------------------------------
def synthesize(gen: Generator, latents: npt.NDArray[np.float32]) -> Tensor:
    """One image per latent, ``[n, ch, R, R]`` in [0, 1] (``synthesize`` already rescales).

    Raises:
        AggregationError: The generator produced NaN or inf for these latents.
    """
    images = gen.synthesize(torch.as_tensor(latents, dtype=torch.float32))
    if not bool(torch.isfinite(images).all()):
        raise AggregationError("generator produced non-finite images from this round's centroids")
    return images


def to_input_spec(images: Tensor, channels: int, height: int, width: int) -> npt.NDArray[np.uint8]:
    """Resize (shorter side) and centre-crop to ``height x width``, convert channels (ITU-R 601
    luma for grey), quantise to uint8; the agent divides by 255 and normalises itself."""
    x = adapt_images(images, channels, (height, width))
    return cast(npt.NDArray[np.uint8], (x * 255.0).round().clamp(0, 255).to(torch.uint8).numpy())


# ----- the matched controls of spec §10 -----------------------------------------------------
def deranged_rows(
    classes: npt.NDArray[np.int64], order: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """Row of ``classes`` whose latent each class receives under the derangement.

    ``order`` is one cyclic order of all C classes, fixed for the run: class c takes the latent
    of the class after it in that cycle, restricted to ``classes`` (the cycle's induced order on
    them, again one cycle). With two or more classes no class keeps its own latent.
    """
    position = np.argsort(order)
    cycle = np.argsort(position[classes], kind="stable")  # rows of ``classes`` in cycle order
    rows = np.empty_like(cycle)
    rows[cycle] = np.roll(cycle, -1)
    return rows


def matched_noise(images: npt.NDArray[np.uint8], rng: np.random.Generator) -> npt.NDArray[np.uint8]:
    """Gaussian noise with, per channel, exactly the mean and std of the image set ``images``
    ``[n, ch, h, w]`` (before rounding and clipping to 0..255), independent of their content."""
    axes = (0, 2, 3)
    x = images.astype(np.float64)
    z = rng.standard_normal(x.shape)
    z = (z - z.mean(axis=axes, keepdims=True)) / np.maximum(z.std(axis=axes, keepdims=True), 1e-12)
    noise = x.mean(axis=axes, keepdims=True) + x.std(axis=axes, keepdims=True) * z
    return cast(npt.NDArray[np.uint8], np.clip(np.round(noise), 0, 255).astype(np.uint8))


def random_latents(gen: Generator, n: int, seed: int) -> npt.NDArray[np.float32]:
    """``n`` valid latents (the generator's own ``sample_w``) drawn from ``seed`` only."""
    w = gen.sample_w(n, torch.Generator().manual_seed(seed))
    return cast(npt.NDArray[np.float32], w.detach().cpu().numpy().astype(np.float32))
