"""FML hyperparameters (Shen et al. 2020, "Federated Mutual Learning"; see
docs/algorithms/baselines.md).

Each device holds its private model (its own architecture, never sent) and a copy of a shared
"meme" model, one small architecture for the whole fleet (``shared_model``, a registry name).
Locally the two learn from each other by deep mutual learning::

    L_private = alpha * CE(private) + (1 - alpha) * KL(p_meme || p_private)
    L_meme    = beta  * CE(meme)    + (1 - beta)  * KL(p_private || p_meme)

and only the meme travels, averaged by sample count as FedAvg averages a model (so this config
extends :class:`FedAvgConfig`: same ``weights`` payload, ``weight_encoding`` and
``sample_weighted``, whose false is HtFLlib's uniform mean).

Defaults: alpha = beta = 0.5 (the paper's setting; HtFLlib's argparse default 1.0 would switch
both KL terms off); training as HtFLlib's ``clientfml``: plain SGD at lr 0.01 for both models,
batch 10, one local epoch, each model's gradient norm clipped at 10.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from protocol.algorithms.base import HTFLLIB_TRAINING, register_config
from protocol.algorithms.fedavg import FedAvgConfig

__all__ = ["CLIENT0_ARCH", "FMLConfig", "SharedModelConfig"]

#: ``shared_model`` value: the architecture of the fleet's first agent (HtFLlib builds the
#: shared model as client 0's); the coordinator replaces it by that registry name before the
#: first round.
CLIENT0_ARCH = "client0_arch"


@dataclass(frozen=True)
class SharedModelConfig(FedAvgConfig):
    """Settings of every algorithm whose devices co-train a private model and a shared one
    (FML's meme, FedKD's mentee), with HtFLlib's training defaults."""

    lr: float = 0.01  # both models (HtFLlib); shared_lr overrides the shared model's
    momentum: float = 0.0  # HtFLlib's plain SGD
    batch_size: int = 10  # HtFLlib
    grad_clip: float = 10.0  # per model (HtFLlib's clip "to prevent divergence")
    # registry name, one for the fleet, or CLIENT0_ARCH (HtFLlib: client 0's architecture)
    shared_model: str = "mlp_s"
    shared_lr: float = 0.0  # 0: same as lr
    # batchmean: KL summed over classes, averaged over samples (the papers' D_KL);
    # elementwise_mean: divided by B x C as well (HtFLlib's nn.KLDivLoss())
    kl_reduction: Literal["batchmean", "elementwise_mean"] = "batchmean"
    # HtFLlib's gradient path: nothing in the distillation is detached, so each model also gets
    # the gradient of the other's distillation terms (FedKD: and of its adaptive weight); false:
    # each model minimises its own objective
    teacher_grad: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shared_lr < 0 or not self.shared_model:
            raise ValueError("shared_lr must be >= 0 and shared_model a registered architecture")


@register_config("fml")
@dataclass(frozen=True)
class FMLConfig(SharedModelConfig):
    """FML: a shared meme model averaged like FedAvg, co-trained with the private model by
    deep mutual learning on the device."""

    alpha: float = 0.5  # private model: alpha * CE + (1 - alpha) * KL
    beta: float = 0.5  # meme model: beta * CE + (1 - beta) * KL
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "htfllib": {
            **HTFLLIB_TRAINING,
            "alpha": 0.5,
            "beta": 0.5,
            "kl_reduction": "elementwise_mean",
            "shared_model": CLIENT0_ARCH,
            "grad_clip": 10.0,
        }
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (0 <= self.alpha <= 1 and 0 <= self.beta <= 1):
            raise ValueError("alpha and beta must be in [0, 1]")
