"""Which handlers a received topic reaches: subscription filters matched as compiled patterns.

Every MQTT client of the toolkit (and the endpoint above it) maps a message's topic to the
handlers whose filters match it. Matching each filter in turn by splitting both strings was, at
a fleet's registration, where every topic is new (one per device), ~22 % of the coordinator's
network thread. Here each filter is compiled once (:func:`protocol.topics.compile_filter`, the
one definition of filter semantics, which :func:`~protocol.topics.matches` uses too), so a new
topic costs one C-level match per filter, and the answer is remembered per topic (a device's
reply topic comes back every round). Handlers come in the order their filters were added
(property-tested against a plain split-based matcher in ``tests/protocol/test_routes.py``).
"""

from __future__ import annotations

import re
import threading
from typing import Generic, TypeVar

from protocol.topics import compile_filter

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
        # ((pattern, handler) per filter, topic -> handlers), replaced together
        self._state: tuple[tuple[tuple[re.Pattern[str], H], ...], dict[str, list[H]]] = ((), {})

    def add(self, topic_filter: str, handler: H) -> None:
        """Route topics matching ``topic_filter`` to ``handler`` (after those added before)."""
        route = (compile_filter(topic_filter), handler)
        with self._lock:
            self._state = ((*self._state[0], route), {})

    def handlers(self, topic: str) -> list[H]:
        """The handlers ``topic`` reaches, in the order they were added (do not modify)."""
        routes, cache = self._state
        found = cache.get(topic)
        if found is not None:
            return found
        found = [handler for pattern, handler in routes if pattern.fullmatch(topic)]
        if self._distinct and len(found) > 1:
            found = list(dict.fromkeys(found))
        if len(cache) >= self._max_cached:
            cache.clear()
        cache[topic] = found
        return found
