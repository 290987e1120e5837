"""The connection under :class:`~protocol.transport.lean_mqtt.LeanMqttTransport`: its state,
the socket (plain or TLS) and the session it opens, and the network thread that reads,
dispatches and writes, keeps the connection alive and reconnects.

The public API (connect, publish, subscribe, close) is in :mod:`protocol.transport.lean_mqtt`.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import ssl
import struct
import threading
import time

from protocol.errors import ConfigError, ConnectError, TransportError
from protocol.transport.base import Handler, TlsOptions, Will
from protocol.transport.mqtt_common import (
    MqttClient,
    SessionRefusedError,
    ended_by_tls_peer,
    tls_refusal,
)
from protocol.transport.mqtt_packets import (
    CONNACK,
    CONNACK_REASONS,
    PINGREQ_PACKET,
    PUBACK,
    PUBLISH,
    SUBACK,
    connect_packet,
    parse_packet,
    subscribe_packet,
)
from protocol.transport.routes import Routes

__all__ = ["READ_SIZE", "LeanConnection", "wake_pair"]


READ_SIZE = 1 << 20


class _LostError(Exception):
    """The connection ended (the broker closed it, a socket error, no PINGRESP)."""


class LeanConnection(MqttClient):
    """The state, socket and network thread of an MQTT 3.1.1 client; the base of
    :class:`~protocol.transport.lean_mqtt.LeanMqttTransport`, which adds the public API."""

    def __init__(
        self,
        *,
        client_id: str,
        host: str = "127.0.0.1",
        port: int = 1883,
        will: Will | None = None,
        username: str | None = None,
        password: str | None = None,
        tls: TlsOptions | None = None,
        keepalive: int = 30,
        clean_session: bool = False,
        connect_timeout: float = 10.0,
        reconnect_min: float = 0.5,
        reconnect_max: float = 30.0,
        flush_timeout: float = 5.0,
        logger: logging.Logger | None = None,
    ) -> None:
        if not 0 < keepalive <= 0xFFFF:
            raise ConfigError(f"keepalive: expected 1..65535 s, got {keepalive}")
        super().__init__(
            client_id=client_id,
            host=host,
            port=port,
            will=will,
            keepalive=keepalive,
            clean_session=clean_session,
            connect_timeout=connect_timeout,
            reconnect_min=reconnect_min,
            reconnect_max=reconnect_max,
            flush_timeout=flush_timeout,
            logger=logger,
        )
        will_spec = None if will is None else (will.topic, will.payload, will.qos, will.retain)
        self._connect_bytes = connect_packet(
            client_id,
            keepalive=keepalive,
            clean_session=clean_session,
            will=will_spec,
            username=username,
            password=password,
        )
        self._tls = None if tls is None else _tls_context(tls)
        self._lock = threading.Lock()
        self._subs: list[tuple[str, Handler, int]] = []
        self._routes: Routes[Handler] = Routes(distinct=True)
        self._inflight: dict[int, bytes] = {}  # QoS 1 packets sent or queued, not yet acked
        self._suback: dict[int, tuple[threading.Event, list[int]]] = {}
        self._out: list[bytes] = []  # queued for the network thread, in order
        self._next_pid = 0
        self._sock: socket.socket | ssl.SSLSocket | None = None
        self._inbuf = bytearray()
        self._wake_r, self._wake_w = wake_pair()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._asleep = False  # the network thread waits in select with nothing queued
        self._started = False
        self._aborting = False

    # -- under self._lock ------------------------------------------------------------------

    def _take_pid(self) -> int:
        if len(self._inflight) + len(self._suback) >= 0xFFFF:
            raise TransportError(
                f"mqtt {self.client_id}: 65535 QoS 1 messages are unacknowledged by "
                f"{self.where}; not queuing more"
            )
        while True:
            self._next_pid = self._next_pid % 0xFFFF + 1
            if self._next_pid not in self._inflight and self._next_pid not in self._suback:
                return self._next_pid

    def _send_subscribe(
        self, filters: list[tuple[str, int]]
    ) -> list[tuple[threading.Event, list[int]]]:
        pid = self._take_pid()
        entry: tuple[threading.Event, list[int]] = (threading.Event(), [])
        self._suback[pid] = entry
        self._out.append(subscribe_packet(pid, filters))
        return [entry]

    # -- connection ------------------------------------------------------------------------

    def _open(self) -> tuple[socket.socket | ssl.SSLSocket, bool]:
        """A new connection with an accepted session: ``(socket, session present)``."""
        deadline = time.monotonic() + self.connect_timeout
        try:
            sock: socket.socket | ssl.SSLSocket = socket.create_connection(
                (self.host, self.port), timeout=self.connect_timeout
            )
        except (OSError, ValueError) as exc:
            raise ConnectError(f"cannot reach MQTT broker at {self.where}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self.host)
            sock.sendall(self._connect_bytes)
            inbuf = bytearray()
            while (found := parse_packet(inbuf)) is None:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = sock.recv(READ_SIZE)
                if not chunk and self._tls is not None:
                    raise tls_refusal(self.where, "end of stream")
                if not chunk:
                    raise ConnectError(
                        f"cannot reach MQTT broker at {self.where}: it closed the connection "
                        "before a CONNACK (is it an MQTT broker?)"
                    )
                inbuf += chunk
        except TimeoutError:
            sock.close()
            raise ConnectError(
                f"cannot reach MQTT broker at {self.where}: no CONNACK within "
                f"{self.connect_timeout:g} s (is it an MQTT broker?)"
            ) from None
        except (OSError, ValueError) as exc:
            sock.close()
            if self._tls is not None and ended_by_tls_peer(exc):
                raise tls_refusal(self.where, exc) from exc
            raise ConnectError(f"cannot reach MQTT broker at {self.where}: {exc}") from exc
        kind, _flags, start, end = found
        if kind != CONNACK or end - start != 2:
            sock.close()
            raise ConnectError(f"MQTT broker at {self.where}: expected CONNACK, got type {kind}")
        code = inbuf[start + 1]
        if code:
            sock.close()
            reason = CONNACK_REASONS.get(code, f"return code {code}")
            raise SessionRefusedError(f"MQTT broker at {self.where} refused the session: {reason}")
        sock.setblocking(False)
        self._inbuf = inbuf[end:]  # what the broker sent right after the CONNACK
        return sock, bool(inbuf[start] & 1)

    def _established(
        self, sock: socket.socket | ssl.SSLSocket, present: bool
    ) -> list[tuple[threading.Event, list[int]]]:
        """Take a new session into use: re-subscribe, then resend what the broker has not
        acknowledged (the session may have lost it; a duplicate is marked DUP)."""
        waits: list[tuple[threading.Event, list[int]]] = []
        with self._lock:
            self._sock, self.session_present = sock, present
            self._out.clear()
            best: dict[str, int] = {}
            for topic_filter, _handler, qos in self._subs:
                best[topic_filter] = max(qos, best.get(topic_filter, 0))
            for entry in self._suback.values():  # SUBACKs of the lost connection never come
                entry[0].set()
            self._suback.clear()
            if best:
                waits = self._send_subscribe(sorted(best.items()))
            self._out.extend(bytes([p[0] | 0x08]) + p[1:] for p in self._inflight.values())
            self._connected = True
        self._attempt = 0
        self.log.info("connected to %s (session present: %s)", self.where, present)
        return waits

    def _drop_socket(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
            self._connected = False
            self._out.clear()  # QoS 1 packets stay in _inflight; QoS 0 and PUBACKs are lost
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    # -- the network thread ----------------------------------------------------------------

    def _run(self) -> None:
        self._notify_connect(self.session_present)
        while not self._stop.is_set():
            sock = self._sock
            if sock is None:
                if not self._reconnect():
                    break
                self._notify_connect(self.session_present)
                continue
            try:
                self._serve(sock)
            except (_LostError, OSError, ValueError) as exc:
                if self._stop.is_set() or self._aborting:
                    break
                self._drop_socket()
                self.log.warning("lost connection to %s (%s); reconnecting", self.where, exc)
        self._connected = False

    def _reconnect(self) -> bool:
        while not self._stop.is_set():
            delay = self._next_delay()
            if self._stop.wait(delay):
                return False
            try:
                sock, present = self._open()
            except ConnectError as exc:
                self.log.info("broker at %s: %s; retrying", self.where, exc)
                continue
            self._established(sock, present)
            return True
        return False

    def _nothing_queued(self) -> bool:
        """No packet waits to be written. :meth:`close` may queue DISCONNECT after
        :meth:`_serve` last took the queue: leaving without it made the broker publish the
        last will ("offline") over a finished run's retained state."""
        with self._lock:
            return not self._out

    def _serve(self, sock: socket.socket | ssl.SSLSocket) -> None:
        """Read, dispatch and write until the connection ends or the transport stops."""
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ)
        selector.register(sock, selectors.EVENT_READ)
        writing = False
        pending = b""  # bytes the socket did not take yet
        last_out = time.monotonic()
        ping_sent: float | None = None  # when the unanswered PINGREQ went out
        try:
            if self._inbuf:
                self._dispatch_buffer()  # sent along with the CONNACK
            while True:
                with self._lock:
                    if self._out:
                        pending = b"".join((pending, *self._out))
                        self._out.clear()
                sent = 0
                if pending:
                    sent = _send(sock, pending)
                    if sent:
                        pending, last_out = pending[sent:], time.monotonic()
                if self._stop.is_set() and not pending and self._nothing_queued():
                    return
                if pending and not writing:
                    selector.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
                    writing = True
                elif not pending and writing:
                    selector.modify(sock, selectors.EVENT_READ)
                    writing = False
                with self._lock:
                    # right after a write, linger 1 ms awake: a sender in full flow (a step's
                    # tasks, a batch's acks) then queues without waking this thread each time
                    self._asleep = not self._out and not sent
                    timeout = 0.0 if self._out else 0.001
                if self._asleep:  # nothing to write: a publish wakes us, else the keepalive
                    timeout = self._until_keepalive(last_out, ping_sent)
                events = selector.select(timeout)
                self._asleep = False
                for key, _mask in events:
                    if key.fileobj is self._wake_r:
                        with contextlib.suppress(BlockingIOError):
                            self._wake_r.recv(4096)
                    elif self._receive(sock):
                        ping_sent = None  # any packet shows the broker is there
                now = time.monotonic()
                if ping_sent is not None and now - ping_sent > self.keepalive:
                    raise _LostError(f"no answer to PINGREQ for {now - ping_sent:.0f} s")
                # the broker drops a client silent for 1.5 x keepalive: speak at half of it
                if ping_sent is None and now - last_out >= self.keepalive / 2:
                    with self._lock:
                        self._out.append(PINGREQ_PACKET)
                    ping_sent = now
        finally:
            selector.close()

    def _until_keepalive(self, last_out: float, ping_sent: float | None) -> float:
        """Seconds until the keepalive acts: a PINGREQ after half the keepalive of silence,
        or giving up on an unanswered one after a whole keepalive. An idle client does not
        wake every second: hundreds of them in one process (a Ray actor's agents) would wake
        hundreds of times a second, each for the GIL."""
        due = last_out + self.keepalive / 2 if ping_sent is None else ping_sent + self.keepalive
        return max(0.0, due - time.monotonic()) + 0.01  # a hair past: the checks are strict

    def _receive(self, sock: socket.socket | ssl.SSLSocket) -> bool:
        """Read what is there and handle every whole packet; whether anything came."""
        got = False
        while True:
            try:
                chunk = sock.recv(READ_SIZE)
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            if not chunk:
                raise _LostError("the broker closed the connection")
            self._inbuf += chunk
            got = True
            if not isinstance(sock, ssl.SSLSocket) or not sock.pending():
                break
        if got:
            self._dispatch_buffer()
        return got

    def _dispatch_buffer(self) -> None:
        buf, pos, acks = self._inbuf, 0, []
        while (found := parse_packet(buf, pos)) is not None:
            kind, flags, start, end = found
            pos = end
            if kind == PUBLISH:
                tlen = buf[start] << 8 | buf[start + 1]
                at = start + 2 + tlen
                topic = buf[start + 2 : at].decode()
                if flags & 0x06:
                    acks.append(b"\x40\x02" + buf[at : at + 2])
                    at += 2
                self._deliver(topic, bytes(buf[at:end]))
            elif kind == PUBACK:
                (pid,) = struct.unpack_from("!H", buf, start)
                with self._lock:
                    self._inflight.pop(pid, None)
            elif kind == SUBACK:
                (pid,) = struct.unpack_from("!H", buf, start)
                with self._lock:
                    entry = self._suback.pop(pid, None)
                if entry is not None:
                    entry[1].extend(buf[start + 2 : end])
                    if 0x80 in entry[1]:
                        self.log.error("broker at %s refused a subscription", self.where)
                    entry[0].set()
        del buf[:pos]
        if acks:  # after the handlers: a message is acknowledged once it was delivered
            with self._lock:
                self._out.append(b"".join(acks))

    def _deliver(self, topic: str, payload: bytes) -> None:
        for handler in self._routes.handlers(topic):
            try:
                handler(topic, payload)
            except Exception:  # a failing handler must not stop the network thread
                self.log.exception("handler for %s failed", topic)


def wake_pair() -> tuple[socket.socket, socket.socket]:
    """A connected socket pair that ``publish`` writes a byte to, to end the thread's select."""
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    return wake_r, wake_w


def _send(sock: socket.socket | ssl.SSLSocket, data: bytes) -> int:
    """Write as much of ``data`` as the socket takes now."""
    total = 0
    view = memoryview(data)
    while total < len(data):
        try:
            sent = sock.send(view[total:])
        except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            break
        if not sent:
            break
        total += sent
    return total


def _tls_context(tls: TlsOptions) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if tls.ca_certs:
        context.load_verify_locations(tls.ca_certs)
    else:
        context.load_default_certs()
    if tls.certfile:
        context.load_cert_chain(tls.certfile, tls.keyfile)
    if tls.insecure:
        context.check_hostname = False  # still verifies the chain, as paho's insecure does
    return context
