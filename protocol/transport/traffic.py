"""Byte accounting of an :class:`~protocol.transport.endpoint.Endpoint` (``WIRE.md``
§Byte accounting): encoded bytes, message and chunk counts per direction and message kind."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["TrafficCounter"]


@dataclass
class TrafficCounter:
    """Encoded bytes, message and chunk counts per (direction, kind); thread-safe. ``bytes``
    are accepted traffic; ``refused`` the bytes of frames refused on receipt."""

    bytes: Counter[tuple[str, str]] = field(default_factory=Counter)
    messages: Counter[tuple[str, str]] = field(default_factory=Counter)
    chunks: Counter[tuple[str, str]] = field(default_factory=Counter)
    refused: Counter[tuple[str, str]] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(
        self, direction: str, kind: str, size: int, *, messages: int = 1, chunks: int = 0
    ) -> None:
        """Record ``size`` encoded bytes of ``messages`` messages (sent as ``chunks`` chunks)."""
        with self._lock:
            self.bytes[(direction, kind)] += size
            self.messages[(direction, kind)] += messages
            if chunks:
                self.chunks[(direction, kind)] += chunks

    def move(self, direction: str, src: str, dst: str, size: int, *, chunks: int = 0) -> None:
        """Re-attribute ``size`` bytes (and ``chunks`` chunk frames) from kind ``src`` to ``dst``.

        Received chunk frames count under ``chunk`` until their message is complete and its
        kind known; then they move to that kind and count as one message of it.
        """
        with self._lock:
            self.bytes[(direction, src)] -= size
            self.bytes[(direction, dst)] += size
            self.messages[(direction, dst)] += 1
            if chunks:
                self.chunks[(direction, src)] -= chunks
                self.chunks[(direction, dst)] += chunks

    def refuse(self, direction: str, kind: str, size: int, *, counted: bool = True) -> None:
        """Count ``size`` bytes of a refused ``kind`` frame; ``counted``: they were counted as
        accepted on receipt (a message a handler refused) and move out of ``bytes``."""
        with self._lock:
            if counted:
                self.bytes[(direction, kind)] -= size
                self.messages[(direction, kind)] -= 1
            self.refused[(direction, kind)] += size

    def snapshot(self) -> dict[str, int]:
        """Accepted bytes: ``{"tx.reply": bytes, "rx.task": bytes, ...}``."""
        with self._lock:
            return {f"{d}.{k}": n for (d, k), n in sorted(self.bytes.items()) if n}

    def refused_snapshot(self) -> dict[str, int]:
        """Refused bytes: ``{"rx.invalid": bytes, "rx.reply": bytes, ...}``."""
        with self._lock:
            return {f"{d}.{k}": n for (d, k), n in sorted(self.refused.items()) if n}

    def total(self, direction: str | None = None) -> int:
        """Total bytes on the wire, accepted and refused, optionally for one direction (``tx``
        or ``rx``)."""
        with self._lock:
            counts = (*self.bytes.items(), *self.refused.items())
            return sum(n for (d, _), n in counts if direction in (None, d))
