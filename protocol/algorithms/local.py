"""Config of local-only training: no knowledge is exchanged (the lower bound every method
must beat)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from protocol.algorithms.base import HTFLLIB_TRAINING, PayloadSpec, TrainConfig, register_config

__all__ = ["LocalConfig"]


@register_config("local")
@dataclass(frozen=True)
class LocalConfig(TrainConfig):
    """Local training only; no knowledge is exchanged (the lower bound)."""

    REPLY_PAYLOADS: ClassVar[dict[str, tuple[PayloadSpec, ...]] | None] = {}  # nothing, ever
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {"htfllib": dict(HTFLLIB_TRAINING)}
