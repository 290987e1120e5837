"""Local-only training, server half: nothing is exchanged (the lower bound every method must
beat)."""

from __future__ import annotations

from coordinator.strategies.base import Strategy, register_strategy
from protocol.algorithms.local import LocalConfig

__all__ = ["LocalStrategy"]


@register_strategy("local")
class LocalStrategy(Strategy[LocalConfig]):
    """Agents train alone; the coordinator only schedules and records."""

    unbuffered_reason = "it has no global update to buffer (each agent trains alone)"
