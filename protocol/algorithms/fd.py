"""FD / FedDistill hyperparameters (Jeong et al. 2018; see docs/algorithms/baselines.md).

Only per-class mean logits travel: each agent uploads the mean logit of every class it trained
on (from the training forward passes), the coordinator averages them per class over the
uploaders, and the next round each agent adds ``kd_weight * distance(logit, global logit of the
sample's class)`` to its cross-entropy, for samples whose class has a global logit.

Defaults are HtFLlib's (``clientdistill``/``serverdistill``; the paper gives no values): lambda
1.0, MSE between logits, plain SGD at lr 0.01 without momentum, batch 10, one local epoch, the
global logits rebuilt from each round's uploads alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from protocol.algorithms.base import (
    HTFLLIB_TRAINING,
    AveragingConfig,
    PayloadSpec,
    register_config,
)
from protocol.contract.payloads import PrototypeSet

__all__ = ["FDConfig"]


@register_config("fd")
@dataclass(frozen=True)
class FDConfig(AveragingConfig):
    """FD: per-class mean logits up, per-class global logits down, CE + lambda * KD to them."""

    DP_STATISTICS: ClassVar[bool] = True  # its per-class means go through edge_agent.dp

    # the logits travel as a PrototypeSet: class ids, one mean vector of C logits each, counts
    REPLY_PAYLOADS: ClassVar[dict[str, tuple[PayloadSpec, ...]] | None] = {
        "train": (PayloadSpec("logits", PrototypeSet),),
    }

    lr: float = 0.01  # HtFLlib
    momentum: float = 0.0  # HtFLlib's plain SGD
    batch_size: int = 10  # HtFLlib
    kd_weight: float = 1.0  # lambda (HtFLlib's --lamda)
    # mse: MSE between the logits (HtFLlib's clientdistill, "FedDistill"); soft_ce: cross-entropy
    # against softmax(global logit) (HtFLlib's later clientfd)
    kd_loss: Literal["mse", "soft_ce"] = "mse"
    # False: the global logits are this round's class means only (HtFLlib); True: a class no
    # participant held this round keeps its last global logit
    carry_absent: bool = False
    logit_encoding: Literal["raw", "f16"] = "raw"
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "htfllib": {**HTFLLIB_TRAINING, "kd_weight": 1.0, "kd_loss": "soft_ce"}
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kd_weight < 0:
            raise ValueError("kd_weight must be >= 0")
