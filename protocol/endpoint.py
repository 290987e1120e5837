"""Typed messaging over a byte transport: encode, count, dedupe, validate, dispatch.

An :class:`Endpoint` is what coordinator and agents use: ``send(topic, body)`` and
``subscribe(filter, handler)`` with :class:`~protocol.codec.Envelope` objects. Rejected input
(undecodable, invalid, oversized, duplicated) is logged and counted, never delivered and never
raised into the transport's thread.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol.codec import Envelope, Limits, decode, encode
from protocol.errors import ProtocolError
from protocol.messages import Message
from protocol.transport import Transport

__all__ = ["Endpoint", "EnvelopeHandler", "TrafficCounter"]

EnvelopeHandler = Callable[[Envelope, str], None]


@dataclass
class TrafficCounter:
    """Encoded bytes and message counts per (direction, kind); thread-safe."""

    bytes: Counter[tuple[str, str]] = field(default_factory=Counter)
    messages: Counter[tuple[str, str]] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, direction: str, kind: str, size: int) -> None:
        """Record one message of ``size`` encoded bytes."""
        with self._lock:
            self.bytes[(direction, kind)] += size
            self.messages[(direction, kind)] += 1

    def snapshot(self) -> dict[str, int]:
        """``{"tx.reply": bytes, "rx.task": bytes, ...}``."""
        with self._lock:
            return {f"{d}.{k}": n for (d, k), n in sorted(self.bytes.items())}

    def total(self, direction: str | None = None) -> int:
        """Total bytes, optionally for one direction (``tx`` or ``rx``)."""
        with self._lock:
            return sum(n for (d, _), n in self.bytes.items() if direction in (None, d))


class Endpoint:
    """Send and receive typed envelopes for one participant (``sender``) of a federation."""

    def __init__(
        self,
        transport: Transport,
        *,
        sender: str,
        federation: str = "default",
        limits: Limits = Limits(),
        dedupe_window: int = 4096,
        logger: logging.Logger | None = None,
    ) -> None:
        self.transport = transport
        self.sender = sender
        self.federation = federation
        self.limits = limits
        self.traffic = TrafficCounter()
        self.rejected: Counter[str] = Counter()
        self.log = logger or logging.getLogger(f"edgefl.endpoint.{sender}")
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._seen_lock = threading.Lock()
        self._dedupe_window = dedupe_window

    def send(
        self,
        topic: str,
        body: Message,
        *,
        round: int = 0,
        qos: int = 1,
        retain: bool = False,
        msg_id: str | None = None,
    ) -> Envelope:
        """Encode ``body`` in an envelope from this endpoint and publish it."""
        kwargs = {"msg_id": msg_id} if msg_id else {}
        env = Envelope(body=body, sender=self.sender, federation=self.federation, round=round, **kwargs)
        self.send_envelope(topic, env, qos=qos, retain=retain)
        return env

    def send_envelope(self, topic: str, env: Envelope, *, qos: int = 1, retain: bool = False) -> None:
        """Publish an already built envelope (e.g. a reply resent from an outbox)."""
        data = encode(env)
        self.transport.publish(topic, data, qos=qos, retain=retain)
        self.traffic.add("tx", env.kind, len(data))

    def subscribe(self, topic_filter: str, handler: EnvelopeHandler, qos: int = 1) -> None:
        """Deliver valid, first-seen envelopes matching ``topic_filter`` to ``handler``."""

        def on_bytes(topic: str, data: bytes) -> None:
            env = self._accept(topic, data)
            if env is not None:
                handler(env, topic)

        self.transport.subscribe(topic_filter, on_bytes, qos)

    def _accept(self, topic: str, data: bytes) -> Envelope | None:
        if not data:  # an empty retained message clears a topic; nothing to deliver
            return None
        try:
            env = decode(data, self.limits)
        except ProtocolError as exc:
            self.rejected[type(exc).__name__] += 1
            self.log.warning("rejected %d bytes on %s: %s", len(data), topic, exc)
            return None
        self.traffic.add("rx", env.kind, len(data))
        if self._is_duplicate(env):
            self.rejected["duplicate"] += 1
            self.log.debug("duplicate %s %s from %s", env.kind, env.msg_id, env.sender)
            return None
        return env

    def _is_duplicate(self, env: Envelope) -> bool:
        key = (env.sender, env.msg_id)
        with self._seen_lock:
            if key in self._seen:
                return True
            self._seen[key] = None
            if len(self._seen) > self._dedupe_window:
                self._seen.popitem(last=False)
        return False
