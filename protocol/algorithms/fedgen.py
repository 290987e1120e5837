"""FedGen hyperparameters (Zhu et al., ICML 2021; HtFLlib ``clientgen``/``servergen``).

Agents upload their heads; the server trains a label-conditional generator of features
(``[uniform noise, one-hot label] -> Linear -> BatchNorm -> ReLU -> Linear -> feature``) so that
the sample-weighted ensemble of the uploaded heads classifies its output as the label, and sends
it down with the fleet's label distribution (and, as HtFLlib, the sample-weighted mean head);
each agent adds the cross-entropy of its head on generated features of sampled labels. The
generator works in the federation's feature space (``feature_dim``), which is what lets
heterogeneous extractors share it. Defaults from HtFLlib: noise and hidden width 512, Adam
lr 0.005, 100 server steps of batch 10 per round, generated-loss weight 1; clients' plain SGD
(lr 0.01, no momentum, batch 10).
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
from protocol.contract.payloads import TensorMap

__all__ = ["FedGenConfig"]


@register_config("fedgen")
@dataclass(frozen=True)
class FedGenConfig(AveragingConfig):
    """FedGen: heads up; a server-trained feature generator down; CE on generated features."""

    REPLY_PAYLOADS: ClassVar[dict[str, tuple[PayloadSpec, ...]] | None] = {
        "train": (PayloadSpec("weights", TensorMap),),  # the agent's head
    }

    momentum: float = 0.0
    batch_size: int = 10
    noise_dim: int = 512
    hidden_dim: int = 512
    generator_lr: float = 0.005  # Adam, fresh each round
    server_steps: int = 100  # generator updates per round (HtFLlib's server_epochs)
    server_batch_size: int = 10
    gen_weight: float = 1.0  # weight of the edge's CE on generated features
    head_exchange: bool = True  # the sample-weighted mean head goes down too (HtFLlib)
    # True: every agent's head starts from one seeded head before round 1 (HtFLlib sends
    # client 0's head to every client first); False: each agent's own
    shared_head: bool = False
    generator_encoding: Literal["raw", "f16", "i8"] = "raw"
    head_encoding: Literal["raw", "f16", "i8"] = "raw"
    # bounded: the generator's sizes (every agent builds it) and the server's work per round
    LIMITS: ClassVar[dict[str, tuple[float, float]]] = {
        "noise_dim": (1, 65_536),
        "hidden_dim": (1, 65_536),
        "server_steps": (0, 100_000),
        "server_batch_size": (2, 65_536),
    }
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "htfllib": {
            **HTFLLIB_TRAINING,
            "noise_dim": 32,
            "generator_lr": 0.1,
            "hidden_dim": 512,
            "server_steps": 100,
            "server_batch_size": 10,
            "gen_weight": 1.0,
            "head_exchange": True,
            "shared_head": True,
        }
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if min(self.noise_dim, self.hidden_dim) < 1 or self.server_batch_size < 2:
            raise ValueError("noise_dim, hidden_dim >= 1, server_batch_size >= 2 (BatchNorm)")
        if self.server_steps < 0 or self.generator_lr <= 0 or self.gen_weight < 0:
            raise ValueError("server_steps >= 0, generator_lr > 0, gen_weight >= 0")
