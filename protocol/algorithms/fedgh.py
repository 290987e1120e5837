"""FedGH hyperparameters (Yi et al., ACM MM 2023; HtFLlib ``clientgh``/``servergh``).

Agents train with plain cross-entropy and upload class prototypes; the server trains one global
head (``Linear(feature_dim, C)``) on every uploaded (prototype, class) pair with cross-entropy and
sends it down; each agent replaces its classifier with it before training. Defaults from
HtFLlib: clients' plain SGD (lr 0.01, no momentum, batch 10); server SGD lr 0.01 (``-slr``),
one server epoch per round (the authors' scripts run FedGH with ``-se 1``), batch 10.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from protocol.algorithms.base import (
    HTFLLIB_TRAINING,
    PayloadSpec,
    ScreeningConfig,
    register_config,
)
from protocol.contract.payloads import PrototypeSet

__all__ = ["FedGHConfig"]


@register_config("fedgh")
@dataclass(frozen=True)
class FedGHConfig(ScreeningConfig):
    """FedGH: prototypes up; a server-trained global head down, loaded into every classifier."""

    DP_STATISTICS: ClassVar[bool] = True  # its per-class means go through edge_agent.dp

    REPLY_PAYLOADS: ClassVar[dict[str, tuple[PayloadSpec, ...]] | None] = {
        "train": (PayloadSpec("protos", PrototypeSet),),
    }

    momentum: float = 0.0
    batch_size: int = 10
    server_epochs: int = 1  # epochs over the round's uploaded prototypes
    server_lr: float = 0.01  # SGD, fresh each round
    server_batch_size: int = 10
    proto_encoding: Literal["raw", "f16"] = "raw"
    head_encoding: Literal["raw", "f16", "i8"] = "raw"
    # True: one seeded head is every agent's start and the server's first head (HtFLlib's
    # server starts from client 0's head and sends it before round 1); False: each agent's
    # own head until the server's first, which starts from the step's seed
    shared_head: bool = False
    LIMITS: ClassVar[dict[str, tuple[float, float]]] = {
        "server_epochs": (0, 10_000),
        "server_batch_size": (1, 65_536),
    }
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "htfllib": {
            **HTFLLIB_TRAINING,
            "server_lr": 0.01,
            "server_epochs": 1,
            "server_batch_size": 10,
            "shared_head": True,
        }
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.server_epochs < 0 or self.server_batch_size < 1 or self.server_lr <= 0:
            raise ValueError("server_epochs >= 0, server_batch_size >= 1, server_lr > 0")
