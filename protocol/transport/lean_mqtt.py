"""MQTT 3.1.1 over a socket of our own: the coordinator's transport at fleet scale.

Why not paho here (``benchmarks/bench_mqtt_clients.py``, 2-core VM,
``docs/howto/run-at-scale.md``): paho
spends 133-136 us of CPU to receive one 8.5 KB QoS 1 message and 146-151 us to publish one
500-byte QoS 1 message, per message, under the GIL; this client, which parses every packet of a
read at once and writes whatever has queued in one call, spends 25-37 us and 26-31 us, close
to a bare socket's 19-20 us and 30-34 us. The coordinator receives a reply and sends an ack and
a task per device and round, so at 10,000 devices paho alone cost seconds per round. Devices
keep paho (:class:`~protocol.transport.paho.MqttTransport`): they send a message or two a round.

What it does, as :class:`~protocol.transport.paho.MqttTransport` does: QoS 0 and 1, retained
messages,
a last will, user name and password, TLS with client certificates, keepalive, persistent or
clean sessions, reconnects with jittered capped exponential backoff, re-subscription on every
connect, and QoS 1 messages kept while disconnected and sent again (DUP) until the broker
acknowledges them. What it does not: MQTT 5 and QoS 2 (the toolkit uses neither; a QoS 2
subscription is made at QoS 1).

Threading: one network thread per transport runs a selector over the socket. Handlers run on
it, one message at a time, and must not block; the PUBACKs of everything one read delivered go
out together once the handlers returned (at-least-once: a crash before that redelivers).
``publish`` from any thread appends to an output queue that the network thread writes in one
call.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Sequence

from protocol.errors import TransportError
from protocol.transport.base import Handler
from protocol.transport.lean_connection import LeanConnection, wake_pair
from protocol.transport.mqtt_packets import DISCONNECT_PACKET, publish_packet

__all__ = ["LeanMqttTransport"]


class LeanMqttTransport(LeanConnection):
    """An MQTT 3.1.1 client over a plain or TLS socket, built for many messages per second.

    Takes the keyword arguments of :class:`~protocol.transport.paho.MqttTransport` that apply to
    MQTT
    3.1.1, so either can be built from the same options.
    """

    # -- lifecycle -------------------------------------------------------------------------

    def _connect_once(self) -> None:
        """One attempt: the session, the network thread, and every subscription made before
        it acknowledged by the broker when this returns."""
        if self._started:
            raise TransportError(f"mqtt {self.client_id}: connect() called twice")
        sock, present = self._open()
        self._started = True
        self._stop.clear()
        if self._wake_r.fileno() < 0:  # closed by an earlier close(): connect() again
            self._wake_r, self._wake_w = wake_pair()
        waits = self._established(sock, present)
        self._thread = threading.Thread(
            target=self._run, name=f"mqtt-{self.client_id}", daemon=True
        )
        self._thread.start()
        for event, _codes in waits:  # subscriptions made before connect hold when it returns
            event.wait(self.connect_timeout)
        self._check_subacks(waits)

    def close(self) -> None:
        """Wait for unacknowledged QoS 1 messages (up to ``flush_timeout``), then disconnect
        cleanly: the broker does not publish the last will. Idempotent."""
        if not self._started:
            return
        end = time.monotonic() + self.flush_timeout
        while self._inflight and self._connected and time.monotonic() < end:
            time.sleep(0.01)
        with self._lock:
            if self._connected:
                self._out.append(DISCONNECT_PACKET)
        self._halt()

    def abort(self) -> None:
        """Drop the TCP connection without DISCONNECT, as a crash would: the broker publishes
        the last will. The transport cannot be reused afterwards."""
        if not self._started:
            return
        self._aborting = True
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._halt()

    def _halt(self) -> None:
        self._stop.set()
        self._wake()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.flush_timeout + 1.0)
        self._started = False
        self._connected = False
        self._drop_socket()
        if thread is None or not thread.is_alive():  # else it still selects on them
            self._wake_r.close()
            self._wake_w.close()

    # -- publish / subscribe ---------------------------------------------------------------

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        """Queue ``payload`` for ``topic``; QoS 1 messages outlive a lost connection.

        Raises:
            TransportError: not connected (QoS 0 while disconnected, or closed), an invalid
                topic or QoS, 65,535 QoS 1 messages unacknowledged, or a packet too large.
        """
        self._check(topic, payload, qos)
        with self._lock:
            self._queue(topic, payload, qos, retain)
            wake, self._asleep = self._asleep, False  # one wake-up per sleep, not per message
        if wake:
            self._wake()

    def publish_many(self, messages: Sequence[tuple[str, bytes]], *, qos: int = 1) -> None:
        """:meth:`publish` each ``(topic, payload)`` in order under one lock: a step's tasks
        or a batch's acks (per message, the lock and the call were ~a third of ``publish``).
        Every message's topic, QoS and size are checked before any is queued.

        Raises:
            TransportError: as :meth:`publish`.
        """
        if not messages:
            return  # and the network thread's sleep flag stays as it is
        for topic, payload in messages:
            self._check(topic, payload, qos)
        with self._lock:
            for topic, payload in messages:
                self._queue(topic, payload, qos, False)
            wake, self._asleep = self._asleep, False
        if wake:
            self._wake()

    def _check(self, topic: str, payload: bytes, qos: int) -> None:
        if not self._started:
            raise TransportError(
                f"publish to {topic}: mqtt transport {self.client_id} is not connected"
            )
        if qos not in (0, 1) or not topic or "+" in topic or "#" in topic:
            raise TransportError(f"publish to {topic!r}: invalid topic or qos {qos!r}")
        limit = self.max_packet_size
        if limit is not None and len(payload) + len(topic.encode()) + 16 > limit:
            raise TransportError(
                f"publish to {topic}: {len(payload)} bytes exceed the broker's maximum packet "
                f"size of {limit} bytes"
            )

    def _queue(self, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        """Queue one checked message's packet (holding the lock)."""
        if not qos:
            if not self._connected:
                raise TransportError(
                    f"publish to {topic} (qos 0) was not queued: not connected to {self.where}"
                )
            self._out.append(_packet(topic, payload, 0, 0, retain))
            return
        pid = self._take_pid()
        packet = _packet(topic, payload, 1, pid, retain)
        self._inflight[pid] = packet
        if self._connected:
            self._out.append(packet)  # else sent with the others once the connection is back

    def subscribe(self, topic_filter: str, handler: Handler, qos: int = 1) -> None:
        """Deliver messages matching ``topic_filter`` to ``handler``, now and after reconnects.

        When connected, and not called from a handler, this waits for the broker's SUBACK.

        Raises:
            TransportError: invalid filter or QoS, or the broker refused the subscription.
        """
        if not topic_filter or qos not in (0, 1, 2):
            raise TransportError(f"subscribe: invalid filter {topic_filter!r} or qos {qos!r}")
        with self._lock:
            self._subs.append((topic_filter, handler, min(qos, 1)))
            self._routes.add(topic_filter, handler)
            waits = self._send_subscribe([(topic_filter, min(qos, 1))]) if self._connected else []
        # from a handler the SUBACK can only arrive after it returns: do not wait for it there
        if waits and threading.current_thread() is not self._thread:
            self._wake()
            waits[0][0].wait(self.connect_timeout)
            self._check_subacks(waits)

    def _check_subacks(self, waits: list[tuple[threading.Event, list[int]]]) -> None:
        refused = [code for _event, codes in waits for code in codes if code == 0x80]
        if refused:
            raise TransportError(f"broker at {self.where} refused subscription(s)")


def _packet(topic: str, payload: bytes, qos: int, pid: int, retain: bool) -> bytes:
    try:
        return publish_packet(topic, payload, qos, pid, retain=retain)
    except ValueError as exc:
        raise TransportError(f"publish to {topic}: {exc}") from exc
