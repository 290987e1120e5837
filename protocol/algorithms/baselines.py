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

    proto_weight: float = 1.0  # FedProto's lambda
    proto_encoding: Literal["raw", "f16"] = "raw"
    predict: Literal["head", "prototype"] = "head"  # prototype: nearest global prototype
