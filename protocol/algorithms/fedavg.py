"""Config of FedAvg: sample-weighted averaging of full weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from protocol.algorithms.base import AveragingConfig, PayloadSpec, register_config
from protocol.contract.payloads import TensorMap

__all__ = ["FedAvgConfig"]


@register_config("fedavg")
@dataclass(frozen=True)
class FedAvgConfig(AveragingConfig):
    """FedAvg: sample-weighted averaging of full weights (homogeneous fleets only)."""

    REPLY_PAYLOADS: ClassVar[dict[str, tuple[PayloadSpec, ...]] | None] = {
        "train": (PayloadSpec("weights", TensorMap),),
    }
    DP_SGD: ClassVar[bool] = True  # hyper.dp: the weights are trained by DP-SGD

    weight_encoding: Literal["raw", "f16", "i8"] = "raw"  # uploaded and broadcast weights
    # true: each upload weighs its sample count (FedAvg); false: every upload weighs the same
    # (HtFLlib's FML and FedKD servers average uniformly)
    sample_weighted: bool = True
