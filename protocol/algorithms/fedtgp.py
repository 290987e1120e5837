"""FedTGP hyperparameters (Zhang et al., AAAI 2024; HtFLlib ``clienttgp``/``servertgp``).

The edge is FedProto's (CE + lambda * MSE to the global prototype, prototypes up), so the config
extends :class:`FedProtoConfig`; the server adds the trainable global prototypes (TGP) and their
adaptive-margin contrastive loss (ACL). Defaults: lambda 0.1, S = 100 server epochs and margin
threshold tau = 100 (HtFLlib's ``total.sh`` runs ``-lam 10 -se 100 -mart 100``: the
``htfllib`` preset); the clients train with HtFLlib's plain SGD (lr 0.01, no momentum, batch
10); the server's SGD learning rate is the clients' (0.01) and its batch size HtFLlib's
``-lbs`` (10); the generator's hidden width is the feature dimension; clients predict by
nearest global prototype (HtFLlib's ``clienttgp.test_metrics``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from protocol.algorithms.base import HTFLLIB_TRAINING, ScreeningConfig, register_config
from protocol.algorithms.fedproto import FedProtoConfig

__all__ = ["FedTGPConfig"]


@register_config("fedtgp")
@dataclass(frozen=True)
class FedTGPConfig(FedProtoConfig, ScreeningConfig):
    """FedTGP: FedProto's edge; the server trains global prototypes with an adaptive margin."""

    momentum: float = 0.0  # HtFLlib clients: plain SGD, lr 0.01, batch 10
    batch_size: int = 10
    proto_weight: float = 0.1  # lambda
    predict: Literal["head", "prototype", "cosine"] = "prototype"  # as FedProto's
    # FedProto's common start is off: FedTGP has not been measured with it
    shared_init: Literal["none", "architecture", "head"] = "none"
    server_epochs: int = 100  # S: epochs over the round's uploaded prototypes
    server_lr: float = 0.01  # SGD, fresh each round
    server_batch_size: int = 10
    margin_threshold: float = 100.0  # tau: the margin is min(max class gap, tau)
    tgp_hidden_dim: int = 0  # 0: the feature dimension (HtFLlib)
    LIMITS: ClassVar[dict[str, tuple[float, float]]] = {
        **FedProtoConfig.LIMITS,
        "server_epochs": (0, 10_000),
        "server_batch_size": (1, 65_536),
        "tgp_hidden_dim": (0, 65_536),
    }
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "htfllib": {
            **HTFLLIB_TRAINING,
            "proto_weight": 10.0,
            "server_epochs": 100,
            "margin_threshold": 100.0,
            "server_lr": 0.01,
            "server_batch_size": 10,
            "predict": "prototype",
            "shared_init": "architecture",
        }
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.server_epochs < 0 or self.server_batch_size < 1 or self.tgp_hidden_dim < 0:
            raise ValueError("server_epochs >= 0, server_batch_size >= 1, tgp_hidden_dim >= 0")
        if self.server_lr <= 0 or self.margin_threshold < 0 or self.proto_weight < 0:
            raise ValueError("server_lr > 0, margin_threshold >= 0, proto_weight >= 0")
