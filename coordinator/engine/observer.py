"""What the engine tells an observer of a live run, at the point where each thing happens.

A metrics exporter (``coordinator serve --metrics-port``,
:mod:`coordinator.tracking.prometheus`) is one; the engine knows only this interface, never the
exporter's library. Events are pushed (a step opened or closed, replies accepted, a message
refused, agents heard, a store commit); the values that change between events (the inbox's
depth, the agents online) are read when the observer asks, through :class:`LiveRun`, so they
cost the engine nothing. Every event is called on the engine's thread and must return at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from coordinator.strategies import Step

__all__ = ["LiveRun", "NoObserver", "RunObserver"]


@dataclass(frozen=True)
class LiveRun:
    """A run's identity and its live values, each read when asked (from any thread)."""

    run_id: str
    algorithm: str
    federation: str
    steps: Callable[[], int]  # steps in the plan (an early stop shortens it)
    queue_depth: Callable[[], int]  # messages waiting for the engine's thread
    agents_registered: Callable[[], int]
    agents_online: Callable[[], int]
    frames_refused: Callable[[], Mapping[str, int]]  # by the transport, before the engine


class RunObserver(Protocol):
    """Receives a run's events (see the module's docstring)."""

    def watch(self, run: LiveRun) -> None:
        """The run starts: its identity and where to read its live values."""

    def step_opened(self, idx: int, step: Step) -> None:
        """Step ``idx`` (0-based, in the plan) is collecting replies."""

    def step_closed(self, record: Mapping[str, Any]) -> None:
        """A step closed: its line of ``metrics.jsonl``, already written."""

    def replies_accepted(self, count: int) -> None:
        """``count`` replies were taken into the open step."""

    def refused(self, reason: str) -> None:
        """A message was refused by the engine (the counter it is logged under)."""

    def heard(self, devices: Iterable[str], when: float) -> None:
        """``devices`` were heard from; ``when`` is the ``last_seen`` the store holds now."""

    def committed(self, seconds: float) -> None:
        """A store transaction committed; ``seconds`` its ``COMMIT`` took."""


class NoObserver:
    """Observes nothing (the default)."""

    def watch(self, run: LiveRun) -> None:
        """Nothing to do."""

    def step_opened(self, idx: int, step: Step) -> None:
        """Nothing to do."""

    def step_closed(self, record: Mapping[str, Any]) -> None:
        """Nothing to do."""

    def replies_accepted(self, count: int) -> None:
        """Nothing to do."""

    def refused(self, reason: str) -> None:
        """Nothing to do."""

    def heard(self, devices: Iterable[str], when: float) -> None:
        """Nothing to do."""

    def committed(self, seconds: float) -> None:
        """Nothing to do."""
