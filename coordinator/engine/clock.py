"""The engine's clock: where it reads the time and how it waits for messages.

The default, :class:`Clock`, is real time. ``coordinator simulate --clock simulated`` hands the
engine a simulated one (:class:`coordinator.sim.clock.SimulatedClock`): deadlines, reply times
and the metrics' timestamps are then read on it, and a wait for a step's replies passes in
simulated time, not on the wall clock.
"""

from __future__ import annotations

import queue
import time
from typing import TypeVar

from coordinator.engine.replies import take_batch

__all__ = ["Clock"]

T = TypeVar("T")


class Clock:
    """Real time: the engine's default."""

    def time(self) -> float:
        """Seconds since the epoch: deadlines, reply times, the metrics' ``time``."""
        return time.time()

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back: how long a task has been in flight."""
        return time.monotonic()

    def take(self, inbox: queue.Queue[T], timeout: float, *, for_replies: bool = False) -> list[T]:
        """The queued messages, waiting up to ``timeout`` seconds for the first (empty: none
        came). ``for_replies``: the wait of an open step for its replies, the one wait a
        simulated clock may pass in simulated time (waits for agents to join are real)."""
        return take_batch(inbox, timeout)
