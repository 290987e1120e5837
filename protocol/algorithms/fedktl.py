"""FedKTL hyperparameters and set-up digest (``shared/specs/fedktl.md``; see
docs/algorithms/fedktl.md).

Defaults are the spec's: the client trains with ArcFace (s = 64, m = 0.5) on a fixed simplex-ETF
head plus ``mu * L^M``, by plain SGD (lr 0.01, batch 10, clip 100); the server aligns the feature
transformer F with Adam (lr 0.01, batch 100, 100 epochs) on ``MMD + mse_weight * MSE`` and turns
the class centroids into one image per class with a pretrained generator.

What travels between the halves:

* set-up (first task of each agent only): ``setup`` = :class:`TensorMap` with ``etf`` [K, C] and
  the fixed projection ``proj.weight`` [H, K'], ``proj.bias`` [H]; its digest
  (:func:`setup_digest`) travels in every task's config as ``setup_sha256``;
* round start: ``pairs`` = :class:`ImageVectorPairs` (uint8 images at the agent's own input
  spec, float32 latents, ``class_ids`` [C'] and ``round``: the spec's ``pairs.classes`` and
  ``pairs_round``);
* reply: ``protos`` = :class:`PrototypeSet` of unit-norm K-dim class prototypes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from protocol.algorithms.base import (
    HTFLLIB_TRAINING,
    PayloadSpec,
    ScreeningConfig,
    register_config,
)
from protocol.contract.payloads import PrototypeSet

__all__ = ["SETUP_KEYS", "FedKTLConfig", "setup_digest"]

#: The tensors of the set-up payload, in digest order.
SETUP_KEYS = ("etf", "proj.bias", "proj.weight")


def setup_digest(tensors: Mapping[str, Any]) -> str:
    """SHA-256 of the set-up tensors: name, shape and little-endian float32 bytes of each, in
    :data:`SETUP_KEYS` order (independent of the transport's dict order)."""
    h = hashlib.sha256()
    for name in SETUP_KEYS:
        arr = np.ascontiguousarray(np.asarray(tensors[name]), dtype="<f4")
        h.update(f"{name}:{list(arr.shape)}:".encode())
        h.update(arr.tobytes())
    return h.hexdigest()


@register_config("fedktl")
@dataclass(frozen=True)
class FedKTLConfig(ScreeningConfig):
    """Both halves of FedKTL; the ``server_*``, ``generator*`` and MMD settings stay on the
    coordinator but travel in the task config like every other field."""

    # ----- client (spec §4.1, §4.2, §4.5: the authors' code) -----
    batch_size: int = 10
    lr: float = 0.01
    momentum: float = 0.0
    grad_clip: float = 100.0
    arc_scale: float = 64.0  # ArcFace s
    arc_margin: float = 0.5  # ArcFace m
    mu: float = 50.0  # weight of L^M (0: the "-L^M" ablation, local training with the ETF)
    proj_grad_clip: float = 100.0  # h' has its own SGD step with this clip norm
    proto_encoding: Literal["raw", "f16"] = "raw"
    # ----- shapes -----
    etf_dim: int = 0  # K; 0 = num_classes. Agents' models need num_features == K (their
    # forward_features is g = h o f, the embedding the exported cosine head reads)
    feature_dim: int = 32  # K': the extractor output h' reads (the trunk average-pooled to K')
    latent_dim: int = 0  # H; 0 = the generator's; otherwise it must equal the generator's
    # ----- server (spec §3.4, §4.4, §4.5) -----
    server_lr: float = 0.01
    server_batch_size: int = 100
    server_epochs: int = 100
    server_grad_clip: float = 100.0  # one norm over F and the centroid table (see docs)
    mse_weight: float = 1.0  # lambda (0: the "-L^MSE" ablation)
    mmd_weight: float = 1.0  # 0: the "-L^MMD" ablation (the paper's loss has 1)
    mmd_bandwidth: Literal["fixed", "median"] = "fixed"  # {10, 15, 20, 50} or median heuristic
    pair_encoding: Literal["raw", "f16"] = "raw"  # the latents; images are always uint8
    # ----- matched controls of spec §10 (server only; the agents run unchanged) -----
    # derangement: each image's latent is another class's (one fixed cyclic derangement of the
    # classes for the whole run); noise_images: the images replaced by noise of the same
    # per-channel mean and std over the image set, true latents; random_latents: C valid
    # latents drawn once from the run seed, the uploads ignored (no F, no centroids)
    control: Literal["none", "derangement", "noise_images", "random_latents"] = "none"
    # ----- generator (spec §9.1) -----
    generator: Literal["dcgan_face", "cppn", "torchscript", "onnx", "entry_point"] = "dcgan_face"
    generator_path: str = ""  # torchscript file, onnx manifest or entry-point weights
    generator_entry: str = ""  # "pkg.module:factory" for generator = entry_point
    generator_state_key: str = ""  # key of the state dict inside the weights file, if any
    cppn_w_dim: int = 16
    cppn_channels: int = 3
    cppn_resolution: int = 32
    cppn_seed: int = 0
    # ----- filled by the coordinator -----
    setup_sha256: str = ""  # digest of the set-up every agent must hold

    # its unit prototypes are normalised per-class sums, noised through edge_agent.dp first
    DP_STATISTICS: ClassVar[bool] = True
    REPLY_PAYLOADS: ClassVar[dict[str, tuple[PayloadSpec, ...]] | None] = {
        "train": (PayloadSpec("protos", PrototypeSet),),
    }
    # the authors' run_me.sh (TsingZ0/FedKTL), StyleGAN-XL line: our defaults already, and
    # HtFLlib's client training
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "htfllib": {
            **HTFLLIB_TRAINING,
            "server_lr": 0.01,
            "server_batch_size": 100,
            "server_epochs": 100,
            "mse_weight": 1.0,
            "mu": 50.0,
            # K' = 512: h' reads the whole 512-d feature vector of HtFLlib's networks, as h
            # does (the authors' -fd 512); the default K' = 32 is the spec's edge setting
            "feature_dim": 512,
        }
    }
    # sizes and epochs a task may ask for: the agent builds ETF, h' and images of these sizes, the
    # coordinator trains F for server_epochs every round
    LIMITS: ClassVar[dict[str, tuple[float, float]]] = {
        "etf_dim": (0, 65_536),
        "feature_dim": (1, 65_536),
        "latent_dim": (0, 65_536),
        "server_epochs": (0, 10_000),
        "server_batch_size": (1, 65_536),
        "cppn_w_dim": (1, 65_536),
        "cppn_channels": (1, 4),
        "cppn_resolution": (1, 1024),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if min(self.etf_dim, self.latent_dim) < 0 or self.feature_dim < 1:
            raise ValueError("etf_dim, latent_dim >= 0 (0 = derived) and feature_dim >= 1")
        if min(self.mu, self.mse_weight, self.mmd_weight) < 0 or self.arc_scale <= 0:
            raise ValueError("mu, mse_weight, mmd_weight >= 0 and arc_scale > 0")
        if self.proj_grad_clip < 0 or self.server_grad_clip < 0:
            raise ValueError("proj_grad_clip and server_grad_clip >= 0")
        if min(self.server_batch_size, self.cppn_w_dim, self.cppn_channels) < 1:
            raise ValueError("server_batch_size, cppn sizes >= 1")
        if self.server_epochs < 0 or self.server_lr <= 0 or self.cppn_resolution < 1:
            raise ValueError("server_epochs >= 0, server_lr > 0, cppn_resolution >= 1")
        if self.setup_sha256 and len(self.setup_sha256) != 64:
            raise ValueError("setup_sha256 is a 64-hex-digit SHA-256 (set by the coordinator)")

    def etf_size(self, num_classes: int) -> int:
        """K for ``num_classes`` classes."""
        return self.etf_dim or num_classes

    def model_feature_dim(self, num_classes: int) -> int:
        """K: ``forward_features`` is the ETF-space embedding g = h o f."""
        return self.etf_size(num_classes)
