"""Log set-up shared by the ``coordinator`` and ``edge-agent`` CLIs: text or one JSON object a
line (for journald, Loki, jq)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

__all__ = ["JsonFormatter", "RefusalLog", "listing", "setup_logging"]

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message (and the traceback, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": record.created,
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(level: int | str, fmt: str) -> None:
    """Root logging to stderr at ``level`` in ``fmt`` (``text`` or ``json``)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(
        level=level.upper() if isinstance(level, str) else level, handlers=[handler]
    )


def listing(items: list[str], limit: int) -> str:
    """``items`` joined, the first ``limit`` of them and a count of the rest: a log line or an
    error message about many things stays short (the online line of 10,000 agents was 110 KB).
    """
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit} more"


class RefusalLog:
    """Logs refusals (frames, messages, registrations not acted on) so that a flood cannot
    flood the log: the first ``first`` of every ``interval_s`` one line each, the rest counted
    by reason and summed up in one line when the interval is over ("refused 12,345 frames in
    the last 10 s (12,335 not logged one by one): late 12,000, invalid_reply 345").

    Thread-safe. An interval's summary is written at the first refusal or :meth:`tick` after
    it ends, and by :meth:`flush`; call :meth:`tick` from a loop that runs anyway.
    """

    def __init__(
        self,
        log: logging.Logger,
        *,
        what: str = "frames",
        first: int = 10,
        interval_s: float = 10.0,
        level: int = logging.WARNING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log, self.what, self.first, self.interval_s = log, what, first, interval_s
        self.level, self.clock = level, clock
        self._lock = threading.Lock()
        self._start = clock()
        self._reasons: Counter[str] = Counter()  # this interval's refusals by reason
        self._unlogged = 0

    def __call__(self, reason: str, msg: str, *args: object) -> None:
        """One refusal for ``reason``: ``msg % args`` is logged if few came this interval."""
        with self._lock:
            self._roll(self.clock(), force=False)
            self._reasons[reason] += 1
            logged = self._reasons.total() <= self.first
            if not logged:
                self._unlogged += 1
        if logged:
            self.log.log(self.level, msg, *args)

    def tick(self) -> None:
        """Write the summary of an interval that is over."""
        with self._lock:
            self._roll(self.clock(), force=False)

    def flush(self) -> None:
        """Write the summary of the refusals not logged so far (at the end of a run)."""
        with self._lock:
            self._roll(self.clock(), force=True)

    def _roll(self, now: float, *, force: bool) -> None:
        elapsed = now - self._start
        if not force and elapsed < self.interval_s:
            return
        if self._unlogged:
            reasons = ", ".join(f"{r} {n:,}" for r, n in self._reasons.most_common())
            self.log.log(
                self.level,
                "refused %s %s in the last %.0f s (%s not logged one by one): %s",
                f"{self._reasons.total():,}",
                self.what,
                elapsed,
                f"{self._unlogged:,}",
                reasons,
            )
        self._start, self._reasons, self._unlogged = now, Counter(), 0
