"""Log set-up shared by the ``coordinator`` and ``edge-agent`` CLIs: text or one JSON object a
line (for journald, Loki, jq)."""

from __future__ import annotations

import json
import logging

__all__ = ["JsonFormatter", "listing", "setup_logging"]

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
