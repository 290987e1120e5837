"""The byte-level transport interface and its in-memory implementation.

:class:`Transport` is what the rest of the toolkit sees of MQTT: connect with a last will,
subscribe a handler to a topic filter, publish bytes. ``protocol.transport.paho`` implements it over
paho-mqtt (the only module that imports paho; the devices' client),
``protocol.transport.lean_mqtt`` over
a socket of our own (the coordinator's, at fleet scale); :class:`MemoryTransport` implements it
over a :class:`MemoryBroker` for unit tests and fast single-process simulation.

Handlers run on the transport's delivery thread and must not block: hand work to a queue.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from protocol.contract.topics import matches
from protocol.errors import TransportError

__all__ = [
    "Handler",
    "MemoryBroker",
    "MemoryTransport",
    "TlsOptions",
    "Transport",
    "Will",
    "WrappedTransport",
]

Handler = Callable[[str, bytes], None]


@dataclass(frozen=True, slots=True)
class Will:
    """Last-will message the broker publishes when the client vanishes."""

    topic: str
    payload: bytes
    retain: bool = True
    qos: int = 1


@dataclass(frozen=True, slots=True)
class TlsOptions:
    """TLS settings: CA bundle to verify the broker, optional client certificate and key."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    insecure: bool = False  # skip host name verification (test certificates only)


class Transport(ABC):
    """Publish/subscribe of raw bytes with MQTT semantics (QoS 0/1, retained, last will).

    Subclasses call ``super().__init__()`` first.
    """

    def __init__(self) -> None:
        #: Largest packet the broker accepts, when it says so; ``None`` = unknown.
        self.max_packet_size: int | None = None
        self._connect_listeners: list[Callable[[bool], None]] = []

    def add_connect_listener(self, listener: Callable[[bool], None]) -> None:
        """Call ``listener(session_present)`` after every (re)connect, on the delivery thread.

        Used to re-announce retained state (birth, coordinator state) after a broker restart,
        which loses retained messages when the broker keeps no persistence. Must not block.
        """
        self._connect_listeners.append(listener)

    def _notify_connect(self, session_present: bool) -> None:
        for listener in list(self._connect_listeners):
            try:
                listener(session_present)
            except Exception:  # a listener's bug must not break the transport thread
                logging.getLogger("edgefl.transport").exception("connect listener failed")

    @abstractmethod
    def connect(self) -> None:
        """Connect (blocking until connected or raising :class:`ConnectError`)."""

    @abstractmethod
    def close(self) -> None:
        """Disconnect cleanly (the last will is *not* published)."""

    @abstractmethod
    def subscribe(self, topic_filter: str, handler: Handler, qos: int = 1) -> None:
        """Deliver messages matching ``topic_filter`` to ``handler`` (kept across reconnects)."""

    @abstractmethod
    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        """Publish ``payload``; raises :class:`TransportError` if it cannot be queued."""

    def publish_many(self, messages: Sequence[tuple[str, bytes]], *, qos: int = 1) -> None:
        """:meth:`publish` each ``(topic, payload)`` in order, never retained (a step's tasks,
        a batch's acks). A transport may queue them at once; this one publishes one by one.

        Raises:
            TransportError: as :meth:`publish`, at the first message that cannot be queued
                (the ones before it are queued).
        """
        for topic, payload in messages:
            self.publish(topic, payload, qos=qos)

    @property
    @abstractmethod
    def connected(self) -> bool:
        """Whether the transport currently has a session with the broker."""

    def __enter__(self) -> Transport:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WrappedTransport(Transport):
    """A transport that passes everything to ``inner``: subclasses override only what they
    change (a simulated device's delays, a simulated clock's watch on the coordinator's)."""

    def __init__(self, inner: Transport) -> None:
        super().__init__()
        self.inner = inner

    def connect(self) -> None:
        self.inner.connect()

    def close(self) -> None:
        self.inner.close()

    def subscribe(self, topic_filter: str, handler: Handler, qos: int = 1) -> None:
        self.inner.subscribe(topic_filter, handler, qos)

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        self.inner.publish(topic, payload, qos=qos, retain=retain)

    def publish_many(self, messages: Sequence[tuple[str, bytes]], *, qos: int = 1) -> None:
        self.inner.publish_many(messages, qos=qos)

    def add_connect_listener(self, listener: Callable[[bool], None]) -> None:
        self.inner.add_connect_listener(listener)

    @property
    def connected(self) -> bool:
        return self.inner.connected

    @property  # type: ignore[override]
    def max_packet_size(self) -> int | None:
        return self.inner.max_packet_size

    @max_packet_size.setter
    def max_packet_size(self, value: int | None) -> None:
        pass  # the inner transport's is the one that counts


class MemoryBroker:
    """An in-process broker: topic filters, retained messages and last wills, no network."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._subs: list[tuple[MemoryTransport, str, Handler]] = []
        self._retained: dict[str, bytes] = {}
        self.log = logging.getLogger("edgefl.memory_broker")

    def _subscribe(self, client: MemoryTransport, topic_filter: str, handler: Handler) -> None:
        with self._lock:
            self._subs.append((client, topic_filter, handler))
            retained = [(t, p) for t, p in self._retained.items() if matches(topic_filter, t)]
        for topic, payload in retained:
            handler(topic, payload)

    def _drop(self, client: MemoryTransport) -> None:
        with self._lock:
            self._subs = [s for s in self._subs if s[0] is not client]

    def _publish(self, topic: str, payload: bytes, retain: bool) -> None:
        with self._lock:
            if retain:
                if payload:
                    self._retained[topic] = payload
                else:
                    self._retained.pop(topic, None)
            # A handler registered under several matching filters gets the message once, as an
            # MQTT client receives one copy per message however many of its filters match.
            targets = list(
                dict.fromkeys(h for c, f, h in self._subs if c.connected and matches(f, topic))
            )
        for handler in targets:
            try:
                handler(topic, payload)
            except Exception:  # a broken subscriber must not break the publisher
                self.log.exception("handler for %s failed", topic)


class MemoryTransport(Transport):
    """A client of a :class:`MemoryBroker`; ``kill()`` simulates an abrupt disconnect."""

    def __init__(self, broker: MemoryBroker, client_id: str, *, will: Will | None = None) -> None:
        super().__init__()
        self.broker = broker
        self.client_id = client_id
        self.will = will
        self._connected = False
        self._subs: list[tuple[str, Handler]] = []

    @property
    def connected(self) -> bool:
        """Whether connected to the in-memory broker."""
        return self._connected

    def connect(self) -> None:
        """Attach to the broker and restore subscriptions."""
        self._connected = True
        for topic_filter, handler in self._subs:
            self.broker._subscribe(self, topic_filter, handler)
        self._notify_connect(False)

    def close(self) -> None:
        """Detach cleanly (no last will)."""
        self._connected = False
        self.broker._drop(self)

    def kill(self) -> None:
        """Detach abruptly: the broker publishes the last will."""
        self.close()
        if self.will is not None:
            self.broker._publish(self.will.topic, self.will.payload, self.will.retain)

    def subscribe(self, topic_filter: str, handler: Handler, qos: int = 1) -> None:
        """Subscribe now (if connected) and on every later connect."""
        self._subs.append((topic_filter, handler))
        if self._connected:
            self.broker._subscribe(self, topic_filter, handler)

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        """Deliver synchronously to every matching subscriber."""
        if not self._connected:
            raise TransportError(f"publish to {topic}: memory transport {self.client_id} is closed")
        self.broker._publish(topic, payload, retain)
