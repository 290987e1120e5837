"""Config of FedProto: class prototypes exchanged, CE + lambda * MSE to the global one."""

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

__all__ = ["FedProtoConfig"]


@register_config("fedproto")
@dataclass(frozen=True)
class FedProtoConfig(AveragingConfig):
    """FedProto: CE + lam * MSE(feature, global prototype of its label); prototypes exchanged."""

    DP_STATISTICS: ClassVar[bool] = True  # its per-class means go through edge_agent.dp

    REPLY_PAYLOADS: ClassVar[dict[str, tuple[PayloadSpec, ...]] | None] = {
        "train": (PayloadSpec("protos", PrototypeSet),),
    }

    LIMITS: ClassVar[dict[str, tuple[float, float]]] = {"feature_dim": (0, 65_536)}
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "htfllib": {
            **HTFLLIB_TRAINING,
            "proto_weight": 10.0,
            "predict": "prototype",
            "shared_init": "architecture",
            "proto_source": "training",
        }
    }

    proto_weight: float = 1.0  # FedProto's lambda
    proto_encoding: Literal["raw", "f16"] = "raw"
    # how the server averages a class's prototypes: "uniform", one share per device holding
    # the class (FedProto); "count", by each device's count of the class (the pooled mean:
    # under hyper.dp a device's mean of a few samples is mostly noise, and gets a small share)
    proto_weighting: Literal["uniform", "count"] = "uniform"
    # prototype: the nearest global prototype (L2); cosine: the most aligned one. Noise on a
    # prototype (hyper.dp) adds its squared norm to every L2 distance to it, more for a class
    # of fewer samples, so the nearest is mostly the least noised class; cosine has no such term
    predict: Literal["head", "prototype", "cosine"] = "head"
    # the prototypes' dimension (the agents' --feature-dim); 0: fixed by the first valid reply
    # of round 1, which a forger answering first could choose (docs/concepts/security.md)
    feature_dim: int = 0
    # the agents' common start. "architecture": agents of one architecture start
    # from the same weights (HtFLlib seeds every client's model alike), so their class means
    # agree from round 1; "head" (default): besides, every agent's head starts identical, so
    # each class pulls features the same way in every architecture and the global prototypes
    # are separated from the first rounds; "none": each agent its own start
    shared_init: Literal["none", "architecture", "head"] = "head"
    # what the uploaded prototypes average: "model" = the trained model's features over the
    # local training set (eval mode, after training); "training" = the features the local
    # epochs computed, batch by batch in train mode as the model moved (FedProto's and
    # HtFLlib's clients collect them inside the training loop)
    proto_source: Literal["model", "training"] = "model"
    # what the regulariser compares with the prototypes under hyper.dp: "clipped", each feature
    # clipped to hyper.dp.clip, as in the released means the prototypes average; "raw", each
    # feature as it is, which pulls features far beyond the clip onto its scale (measured: 10
    # points lower on the global test set, docs/concepts/privacy.md)
    dp_regulariser: Literal["raw", "clipped"] = "clipped"

    def model_feature_dim(self, num_classes: int) -> int:
        """``feature_dim``: the size of the exchanged prototypes (0: not declared)."""
        return self.feature_dim
