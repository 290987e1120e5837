"""Configs of the baselines every method must beat: local-only, FedAvg, FedProto."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from protocol.algorithms.base import TrainConfig, register_config

__all__ = ["FedAvgConfig", "FedProtoConfig", "LocalConfig"]


@register_config("local")
@dataclass(frozen=True)
class LocalConfig(TrainConfig):
    """Local training only; no knowledge is exchanged (the lower bound)."""


@register_config("fedavg")
@dataclass(frozen=True)
class FedAvgConfig(TrainConfig):
    """FedAvg: sample-weighted averaging of full weights (homogeneous fleets only)."""

    weight_encoding: Literal["raw", "f16", "i8"] = "raw"  # uploaded and broadcast weights


@register_config("fedproto")
@dataclass(frozen=True)
class FedProtoConfig(TrainConfig):
    """FedProto: CE + lam * MSE(feature, global prototype of its label); prototypes exchanged."""

    proto_weight: float = 1.0  # FedProto's lambda
    proto_encoding: Literal["raw", "f16"] = "raw"
    predict: Literal["head", "prototype"] = "head"  # prototype: nearest global prototype
