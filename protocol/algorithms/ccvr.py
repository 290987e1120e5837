"""CCVR hyperparameters (Luo et al., NeurIPS 2021, "No Fear of Heterogeneity").

FedAvg rounds (the paper calibrates a FedAvg model, so the fleet is homogeneous), then one
``upload_stats`` phase: every agent sends per-class feature means, covariances and counts of the
final global model over its training data (``ClassStats``); the server combines them into global
class means and covariances (the paper's Eq. with the within- and between-client terms), samples
``virtual_per_class`` virtual features per class from ``N(mu_c, Sigma_c)`` and fine-tunes the
global head on them with cross-entropy; the calibrated model goes down in ``final``.
Calibration defaults follow FL-bench's CCVR (the paper ablates M_c and gives no optimiser
settings): 200 virtual features per class, one epoch of plain SGD at the local learning rate
(0.01) with the local batch size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from protocol.algorithms.base import PayloadSpec, register_config
from protocol.algorithms.fedavg import FedAvgConfig
from protocol.contract.payloads import ClassStats, TensorMap

__all__ = ["CCVRConfig"]


@register_config("ccvr")
@dataclass(frozen=True)
class CCVRConfig(FedAvgConfig):
    """CCVR: FedAvg, then the head calibrated on virtual features from global class statistics."""

    REPLY_PAYLOADS: ClassVar[dict[str, tuple[PayloadSpec, ...]] | None] = {
        "train": (PayloadSpec("weights", TensorMap),),
        "upload_stats": (PayloadSpec("stats", ClassStats),),
    }
    # hyper.dp: FedAvg's weights by DP-SGD, and the class means and covariances are formed
    # from noised sums of features, of their outer products and counts (edge_agent.dp)
    DP_STATISTICS: ClassVar[bool] = True

    virtual_per_class: int = 200  # M_c
    calib_epochs: int = 1
    calib_lr: float = 0.01  # plain SGD
    calib_batch_size: int = 32
    stats_encoding: Literal["raw", "f16"] = "raw"
    LIMITS: ClassVar[dict[str, tuple[float, float]]] = {
        "virtual_per_class": (1, 100_000),
        "calib_epochs": (0, 10_000),
        "calib_batch_size": (1, 65_536),
    }

    def dp_statistics_releases(self, releases: int) -> int:
        """One: the statistics leave once, in ``upload_stats``, after the DP-SGD rounds."""
        return 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.virtual_per_class < 1 or self.calib_epochs < 0 or self.calib_batch_size < 1:
            raise ValueError("virtual_per_class >= 1, calib_epochs >= 0, calib_batch_size >= 1")
        if self.calib_lr <= 0:
            raise ValueError("calib_lr > 0")
