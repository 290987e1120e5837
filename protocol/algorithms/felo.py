"""Felo, Velo and FedHe hyperparameters (``shared/specs/felo_velo.md``; see
docs/algorithms/felo_velo.md).

One config family, three registered names, so the halves share code through configuration:

* ``felo``: class-wise mean features and logits up, per-class table means down, KD with
  ``kd_weight * (MSE(feature, server feature) + KL(server logits || logits))``, and FedAvg
  within each architecture group (spec §8-D1).
* ``velo``: Felo whose server features are one sample per class of a conditional VAE trained on
  the coordinator (§5.2); logits are still table means.
* ``fedhe``: logits only, no group averaging (the authors' FedHe; Felo without features).

Defaults are the spec's decisions (paper where it says, the authors' code otherwise): Adam 1e-3,
batch 50, alpha 0.5, warm-up 5 % of rounds, the history window, elementwise-mean KL, the code's
CVAE loss. The code's "10 local steps" is expressed as ``local_epochs`` here (see the doc).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from protocol.algorithms.base import AveragingConfig, PayloadSpec, ScreeningConfig, register_config
from protocol.contract.payloads import FeatureLogitSet, LabelledVectors, TensorMap

__all__ = ["FedHeConfig", "FeloConfig", "VeloConfig"]


@dataclass(frozen=True)
class _FeatureLogitConfig(AveragingConfig):
    """Settings shared by Felo, Velo and FedHe."""

    DP_STATISTICS: ClassVar[bool] = True  # its per-class means go through edge_agent.dp

    optimizer: Literal["sgd", "adam"] = "adam"
    lr: float = 1e-3
    batch_size: int = 50
    kd_weight: float = 0.5  # alpha of Eq. (1)
    use_features: bool = True  # False: no feature MSE (FedHe)
    use_logits: bool = True  # False: no logit KL ("Felo features only")
    same_arch_avg: bool = True  # §8-D1: FedAvg within each architecture group
    # KD starts after max(1, round(warmup_fraction * rounds)) rounds (§8-D2); knowledge is
    # uploaded during warm-up too, so the table is filled when KD starts.
    warmup_fraction: float = 0.05
    # §8-D3: which uploaded entries the server averages (and Velo's CVAE trains on).
    knowledge_window: Literal["history_fifo", "latest_per_client", "current_round"] = "history_fifo"
    history_cap: int = 5000  # entries kept per class under history_fifo (the code's FIFO cap)
    count_weighted: bool = False  # True: entries weighted by their sample counts
    # > 0: entries older than this many rounds leave the table whatever the window (stale
    # features of models long since trained further); 0: no bound
    window_rounds: int = 0
    kl_reduction: Literal["elementwise_mean", "batchmean"] = "elementwise_mean"  # §8-D7
    knowledge_encoding: Literal["raw", "f16"] = "raw"
    weight_encoding: Literal["raw", "f16", "i8"] = "raw"  # group weights, both ways
    # the uploaded features' dimension (the agents' --feature-dim); 0: fixed by the first valid
    # reply of round 1, which a forger answering first could choose (docs/concepts/security.md)
    feature_dim: int = 0
    # the coordinator keeps up to history_cap entries per class
    LIMITS: ClassVar[dict[str, tuple[float, float]]] = {
        "history_cap": (1, 1_000_000),
        "window_rounds": (0, 1_000_000),
        "feature_dim": (0, 65_536),
    }

    REPLY_PAYLOADS: ClassVar[dict[str, tuple[PayloadSpec, ...]] | None] = {
        "train": (
            PayloadSpec("knowledge", FeatureLogitSet),
            PayloadSpec("weights", TensorMap, False),
        ),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kd_weight < 0 or not 0 <= self.warmup_fraction <= 1 or self.history_cap < 1:
            raise ValueError("kd_weight >= 0, warmup_fraction in [0, 1], history_cap >= 1")

    def model_feature_dim(self, num_classes: int) -> int:
        """``feature_dim``: the size of the exchanged class-wise features (0: not declared)."""
        return self.feature_dim

    def dp_sgd_trains(self) -> bool:
        """With ``same_arch_avg`` the model's weights leave: DP-SGD trains it under
        ``hyper.dp``, and the per-class sums take ``dp_share`` of the budget."""
        return self.same_arch_avg

    def dp_uncovered(self) -> str:
        """Velo's individual samples are neither per-class sums nor DP-SGD's weights."""
        if getattr(self, "upload_samples", 0):
            return "upload_samples uploads individual features (set it to 0)"
        return ""

    def warmup_rounds(self, rounds: int) -> int:
        """Rounds of CE-only training before KD (at least one)."""
        return max(1, round(self.warmup_fraction * rounds))


@register_config("felo")
@dataclass(frozen=True)
class FeloConfig(_FeatureLogitConfig):
    """Felo: class-wise features and logits, same-architecture averaging."""


@register_config("fedhe")
@dataclass(frozen=True)
class FedHeConfig(_FeatureLogitConfig):
    """FedHe: class-wise logits only; no features, no weight averaging."""

    use_features: bool = False
    same_arch_avg: bool = False


@register_config("velo")
@dataclass(frozen=True)
class VeloConfig(_FeatureLogitConfig, ScreeningConfig):
    """Velo: Felo with server features sampled from a conditional VAE (§5.2)."""

    cvae_interval: int = 1  # train every this many rounds after warm-up (Table 4)
    cvae_epochs: int = 10
    cvae_lr: float = 1e-3  # Adam, fresh each training event
    cvae_batch_size: int = 50
    cvae_z_dim: int = 1024
    cvae_embed_dim: int = 512
    cvae_hidden: int = 1024
    # §8-D6: "code" = mean MSE + KL summed over batch and latent dims (the authors'); "elbo" =
    # per-sample summed squared error + KL, averaged over the batch.
    cvae_loss: Literal["code", "elbo"] = "code"
    # > 0: each participation also uploads up to this many individual training features per
    # class (a uniform sample of the round's training passes, `samples`), and the CVAE learns
    # their distribution instead of that of class means; 0: class means only (the paper's
    # wire, on which Velo's CVAE can only learn where the means lie)
    upload_samples: int = 0
    REPLY_PAYLOADS: ClassVar[dict[str, tuple[PayloadSpec, ...]] | None] = {
        "train": (
            PayloadSpec("knowledge", FeatureLogitSet),
            PayloadSpec("weights", TensorMap, False),
            PayloadSpec("samples", LabelledVectors, False),
        ),
    }
    LIMITS: ClassVar[dict[str, tuple[float, float]]] = {
        **_FeatureLogitConfig.LIMITS,
        "upload_samples": (0, 65_536),
        "cvae_epochs": (0, 1000),
        "cvae_batch_size": (1, 65_536),
        "cvae_z_dim": (1, 65_536),
        "cvae_embed_dim": (1, 65_536),
        "cvae_hidden": (1, 65_536),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        sizes = (self.cvae_interval, self.cvae_batch_size, self.cvae_z_dim)
        if min(sizes) < 1 or self.cvae_epochs < 0:
            raise ValueError("cvae sizes and interval >= 1, cvae_epochs >= 0")
        if min(self.cvae_embed_dim, self.cvae_hidden) < 1 or self.cvae_lr <= 0:
            raise ValueError("cvae_embed_dim, cvae_hidden >= 1 and cvae_lr > 0")
