"""A one-line training progress bar for agents run on a terminal.

The coordinator gets QoS 0 ``progress`` messages (``EdgeAgent._progress``); a person watching a
device gets this bar on standard error. It redraws in place with ``\\r`` at most every
``interval_s`` and only when the stream is a terminal, so log files (the demo's agent logs, a
systemd journal) never fill with partial lines.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["TerminalProgress"]

WIDTH = 24  # characters of the bar itself


class TerminalProgress:
    """Draws ``[dev] round R phase  [#####.....]  s/t  loss L`` on one line."""

    def __init__(
        self, device_id: str, stream: TextIO | None = None, interval_s: float = 0.1
    ) -> None:
        self.device_id = device_id
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last = float("-inf")  # the first step always draws
        self._open = False  # a line is drawn and not yet ended

    def update(self, round_: int, phase: str, step: int, total: int, loss: float) -> None:
        """Redraw the bar (throttled); the last step of a task ends the line."""
        if not self.enabled:
            return
        now = time.monotonic()
        last_step = step >= total
        if not last_step and now - self._last < self.interval_s:
            return
        self._last = now
        self.stream.write(
            "\r" + render(self.device_id, round_, phase, step=step, total=total, loss=loss)
        )
        if last_step:
            self.stream.write("\n")
        self.stream.flush()
        self._open = not last_step

    def close(self) -> None:
        """End a line left open (a task that failed mid-way) so logs start on a fresh line."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


def render(device_id: str, round_: int, phase: str, *, step: int, total: int, loss: float) -> str:
    """The bar's text (no control characters)."""
    frac = min(max(step / total, 0.0), 1.0) if total > 0 else 1.0
    filled = round(frac * WIDTH)
    bar = "#" * filled + "." * (WIDTH - filled)
    return (
        f"[{device_id}] round {round_} {phase:<8} [{bar}] {step:>{len(str(total))}}/{total}"
        f"  loss {loss:.4f}"
    )
