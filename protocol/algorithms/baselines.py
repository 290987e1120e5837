"""Configs of the baselines every method must beat: local-only, FedAvg, FedProto."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from protocol.algorithms.base import (
    AveragingConfig,
    PayloadSpec,
    TrainConfig,
    register_config,
)
from protocol.payloads import PrototypeSet, TensorMap

__all__ = ["FedAvgConfig", "FedProtoConfig", "LocalConfig"]


@register_config("local")
@dataclass(frozen=True)
class LocalConfig(TrainConfig):
    """Local training only; no knowledge is exchanged (the lower bound)."""

    REPLY_PAYLOADS: ClassVar[dict[str, tuple[PayloadSpec, ...]] | None] = {}  # nothing, ever


@register_config("fedavg")
@dataclass(frozen=True)
class FedAvgConfig(AveragingConfig):
    """FedAvg: sample-weighted averaging of full weights (homogeneous fleets only)."""

    REPLY_PAYLOADS: ClassVar[dict[str, tuple[PayloadSpec, ...]] | None] = {
        "train": (PayloadSpec("weights", TensorMap),),
    }

    weight_encoding: Literal["raw", "f16", "i8"] = "raw"  # uploaded and broadcast weights


@register_config("fedproto")
@dataclass(frozen=True)
class FedProtoConfig(AveragingConfig):
    """FedProto: CE + lam * MSE(feature, global prototype of its label); prototypes exchanged."""

    REPLY_PAYLOADS: ClassVar[dict[str, tuple[PayloadSpec, ...]] | None] = {
        "train": (PayloadSpec("protos", PrototypeSet),),
    }

    LIMITS: ClassVar[dict[str, tuple[float, float]]] = {"feature_dim": (0, 65_536)}

    proto_weight: float = 1.0  # FedProto's lambda
    proto_encoding: Literal["raw", "f16"] = "raw"
    predict: Literal["head", "prototype"] = "head"  # prototype: nearest global prototype
    # the prototypes' dimension (the agents' --feature-dim); 0: fixed by the first valid reply
    # of round 1, which a forger answering first could choose (docs/security.md)
    feature_dim: int = 0
    # the agents' common start (issue 20 §2). "architecture": agents of one architecture start
    # from the same weights (HtFLlib seeds every client's model alike), so their class means
    # agree from round 1; "head" (default): besides, every agent's head starts identical, so
    # each class pulls features the same way in every architecture and the global prototypes
    # are separated from the first rounds; "none": each agent its own start (before issue 20)
    shared_init: Literal["none", "architecture", "head"] = "head"
    # what the uploaded prototypes average: "model" = the trained model's features over the
    # local training set (eval mode, after training); "training" = the features the local
    # epochs computed, batch by batch in train mode as the model moved (FedProto's and
    # HtFLlib's clients collect them inside the training loop)
    proto_source: Literal["model", "training"] = "model"

    def model_feature_dim(self, num_classes: int) -> int:
        """``feature_dim``: the size of the exchanged prototypes (0: not declared)."""
        return self.feature_dim
