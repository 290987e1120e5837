"""A step's deadline: fixed (``run.deadline_s``), or adaptive, from how long the fleet's
devices took to reply in the steps before.

Adaptive (``run.deadline_mode = "adaptive"``): the deadline is the ``deadline_quantile`` of the
last :data:`WINDOW` reply times (seconds from a step's dispatch to each accepted reply) times
``deadline_margin``, bounded below by ``deadline_min_s`` and above by ``deadline_s``. Until
enough replies were seen (:data:`MIN_OBSERVATIONS`) the cap applies, so the first steps (and
the first after a restart: the window is not stored) wait as a fixed deadline would. A device
that misses the deadline in :data:`MISSES_REPORTED` consecutive steps it was selected for is
reported in the log and in each step's record (``missed``), so an operator sees a straggler
instead of a deadline that keeps stretching for it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["MIN_OBSERVATIONS", "MISSES_REPORTED", "WINDOW", "DeadlineRule", "StepDeadline"]

WINDOW = 200  # reply times kept (the latest)
MIN_OBSERVATIONS = 5  # reply times needed before the adaptive rule applies
MISSES_REPORTED = 3  # consecutive misses that make a device reported


@dataclass(frozen=True)
class StepDeadline:
    """A step's deadline in seconds from dispatch, and why it is that long."""

    seconds: float
    reason: str


@dataclass
class DeadlineRule:
    """The deadline of each step, and the devices that keep missing it."""

    cap_s: float
    adaptive: bool = False
    quantile: float = 0.9
    margin: float = 1.5
    floor_s: float = 5.0
    times: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    misses: dict[str, int] = field(default_factory=dict)  # device -> consecutive misses

    def next(self) -> StepDeadline:
        """The next step's deadline."""
        if not self.adaptive:
            return StepDeadline(self.cap_s, "fixed (run.deadline_s)")
        if len(self.times) < MIN_OBSERVATIONS:
            seen = len(self.times)
            why = f"the cap: {seen} reply times seen, {MIN_OBSERVATIONS} needed"
            return StepDeadline(self.cap_s, why)
        q = quantile(self.times, self.quantile)
        seconds = min(self.cap_s, max(self.floor_s, q * self.margin))
        bound = ""
        if seconds == self.cap_s:
            bound = " (the cap)"
        elif seconds == self.floor_s:
            bound = " (the floor)"
        return StepDeadline(
            seconds,
            f"p{100 * self.quantile:g} of the last {len(self.times)} reply times {q:.1f} s "
            f"x {self.margin:g}{bound}",
        )

    def observe(self, reply_s: Mapping[str, float], missed: Iterable[str]) -> list[str]:
        """Take a closed step's reply times (device -> seconds) and the devices that missed its
        deadline; return the devices that have now missed :data:`MISSES_REPORTED` steps in a
        row (or more)."""
        self.times.extend(max(0.0, t) for t in reply_s.values())
        for device in reply_s:
            self.misses.pop(device, None)
        stragglers = []
        for device in missed:
            self.misses[device] = self.misses.get(device, 0) + 1
            if self.misses[device] >= MISSES_REPORTED:
                stragglers.append(device)
        return sorted(stragglers)


def quantile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear interpolation between order statistics)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
