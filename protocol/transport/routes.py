"""Which handlers a received topic reaches: subscription filters matched as compiled patterns.

Every MQTT client of the toolkit (and the endpoint above it) maps a message's topic to the
handlers whose filters match it. Matching each filter in turn by splitting both strings was, at
a fleet's registration, where every topic is new (one per device), ~22 % of the coordinator's
network thread. Here each filter is compiled (:func:`protocol.contract.topics.compile_filter`, the
one
definition of filter semantics, which :func:`~protocol.contract.topics.matches` uses too) into one
pattern for all of them (:func:`_combined`), so a new topic costs one C-level match, and the
answer is remembered per topic (a device's reply topic comes back every round). Handlers come
in the order their filters were added (property-tested against a plain split-based matcher in
``tests/protocol/transport/test_routes.py``).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from typing import Generic, TypeVar

from protocol.contract.topics import compile_filter

__all__ = ["Routes"]

H = TypeVar("H")


class Routes(Generic[H]):
    """Topic filters and their handlers; :meth:`handlers` answers which a topic reaches.

    Thread-safe: :meth:`add` replaces the patterns and the cache as a whole, so a lookup on
    another thread sees the old routes or the new ones, never half of each.

    ``distinct``: a handler added under several matching filters is returned once (an MQTT
    client calls each handler once per message); otherwise once per matching filter.
    ``max_cached``: topics remembered before the cache starts over (a few per device).
    """

    def __init__(self, *, distinct: bool, max_cached: int = 1 << 17) -> None:
        self._distinct = distinct
        self._max_cached = max_cached
        self._lock = threading.Lock()  # serialises add(); lookups read one snapshot
        self._state = _Table[H]((), ())

    def add(self, topic_filter: str, handler: H) -> None:
        """Route topics matching ``topic_filter`` to ``handler`` (after those added before)."""
        with self._lock:
            old = self._state
            self._state = _Table((*old.filters, topic_filter), (*old.handlers, handler))

    def handlers(self, topic: str) -> list[H]:
        """The handlers ``topic`` reaches, in the order they were added (do not modify)."""
        table = self._state
        found = table.cache.get(topic)
        if found is not None:
            return found
        if not table.handlers:
            return []
        hits = table.match(topic)
        found = table.by_hits.get(hits)
        if found is None:  # a new combination of filters: a handful per client
            found = [h for hit, h in zip(hits, table.handlers, strict=True) if hit is not None]
            if self._distinct and len(found) > 1:
                found = list(dict.fromkeys(found))
            if len(table.by_hits) >= self._max_cached:
                table.by_hits.clear()
            table.by_hits[hits] = found
        if len(table.cache) >= self._max_cached:
            table.cache.clear()
        table.cache[topic] = found
        return found


class _Table(Generic[H]):
    """One snapshot of the routes: handlers in order, their filters as one pattern (compiled
    at the first lookup, so that adding N filters compiles once, not N times), caches."""

    __slots__ = ("by_hits", "cache", "filters", "handlers", "pattern")

    def __init__(self, filters: tuple[str, ...], handlers: tuple[H, ...]) -> None:
        self.filters, self.handlers = filters, handlers
        self.pattern: re.Pattern[str] | None = None
        self.by_hits: dict[tuple[str | None, ...], list[H]] = {}  # which filters hit -> handlers
        self.cache: dict[str, list[H]] = {}  # topic -> handlers

    def match(self, topic: str) -> tuple[str | None, ...]:
        """Per filter, in order: ``""`` where ``topic`` matches it, else ``None``."""
        pattern = self.pattern
        if pattern is None:  # two threads may both compile: the same pattern, either is kept
            pattern = self.pattern = _combined(self.filters)
        found = pattern.match(topic)
        assert found is not None  # every alternative may match nothing: it always matches
        return found.groups()


def _combined(filters: Iterable[str]) -> re.Pattern[str]:
    """Every filter in one pattern that always matches at 0: filter i is a lookahead for the
    whole topic followed by an empty group i, else nothing; so ``groups()`` has ``""`` at each
    filter the topic matches and ``None`` elsewhere, in one C-level call for all filters
    (matching each filter in turn was ~5.6 us a new topic for 9 filters, this ~2.8)."""
    parts = [f"(?:(?={compile_filter(f).pattern}\\Z)()|)" for f in filters]
    return re.compile("".join(parts), re.DOTALL)
