"""LG-FedAvg hyperparameters (Liang et al. 2020, "Think locally, act globally"; see
docs/algorithms/baselines.md).

Only the head (the classifier mapping features to logits) travels and is averaged by sample
count, exactly as FedAvg averages a whole model, so this config extends :class:`FedAvgConfig`
(same ``weights`` payload and ``weight_encoding``). The feature extractor stays on the device
and may differ in architecture from agent to agent; the head must have one shape fleet-wide.

Training defaults are HtFLlib's (``clientlg``/``serverlg``): plain SGD at lr 0.01, batch 10, one
local epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from protocol.algorithms.base import HTFLLIB_TRAINING, register_config
from protocol.algorithms.fedavg import FedAvgConfig

__all__ = ["LGFedAvgConfig"]


@register_config("lg_fedavg")
@dataclass(frozen=True)
class LGFedAvgConfig(FedAvgConfig):
    """LG-FedAvg: the head averaged by sample count; every extractor stays local."""

    lr: float = 0.01  # HtFLlib
    momentum: float = 0.0  # HtFLlib's plain SGD
    batch_size: int = 10  # HtFLlib
    # the head already starts from one seed fleet-wide (the edge's shared_modules)
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {"htfllib": dict(HTFLLIB_TRAINING)}
