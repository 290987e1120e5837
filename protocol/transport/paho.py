"""MQTT transport over paho-mqtt 2.x: the only module of edgefl that imports paho.

:class:`MqttTransport` implements :class:`~protocol.transport.base.Transport` with the choices of
``WIRE.md`` §Transport: QoS 1 by default, a persistent session (``clean_session=False``, or
clean start false with a session expiry on MQTT 5), a last will, TCP_NODELAY, re-subscription
on every connect and a jittered, capped exponential reconnect backoff. With ``websocket_path``
it speaks MQTT over WebSockets (``ws://``, with ``tls`` ``wss://``), for devices behind
firewalls that pass HTTPS only.

Threading: paho runs one network thread per transport. Subscribed handlers are called on that
thread, one message at a time, so they must not block: hand real work to a queue. Publishing
from a handler is fine. Exceptions raised by handlers are logged and swallowed so that one bad
handler cannot stop the network thread.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from typing import Any, Literal

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from protocol.errors import ConnectError, TransportError
from protocol.transport.address import DEFAULT_PORT
from protocol.transport.base import Handler, TlsOptions, Will
from protocol.transport.mqtt_common import (
    MqttClient,
    SessionRefusedError,
    ended_by_tls_peer,
    tls_refusal,
)
from protocol.transport.routes import Routes

__all__ = ["DEFAULT_PORT", "MqttTransport", "TlsOptions"]


class MqttTransport(MqttClient):
    """A paho-mqtt client with edgefl's session, reconnect and delivery policy.

    Register subscriptions before :meth:`connect` to receive messages the broker queued for a
    persistent session while the client was away: they arrive right after the CONNACK.
    """

    def __init__(
        self,
        *,
        client_id: str,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        will: Will | None = None,
        username: str | None = None,
        password: str | None = None,
        tls: TlsOptions | None = None,
        keepalive: int = 30,
        clean_session: bool = False,
        protocol: Literal["3.1.1", "5"] = "3.1.1",
        session_expiry: int = 3600,
        connect_timeout: float = 10.0,
        reconnect_min: float = 0.5,
        reconnect_max: float = 30.0,
        max_inflight: int = 20,
        flush_timeout: float = 5.0,
        websocket_path: str | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
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
        self.protocol = protocol
        self.session_expiry = session_expiry
        self.websocket_path = websocket_path
        self._lock = threading.Lock()
        self._subs: list[tuple[str, Handler, int]] = []
        self._routes: Routes[Handler] = Routes(distinct=True)
        self._suback: dict[int, tuple[threading.Event, list[str]]] = {}
        self._connack = threading.Event()
        self._connack_error: str | None = None
        self._started = False
        self._closing = False
        self._aborting = False
        self._loop_ident: int | None = None
        self._tls = tls is not None
        self._awaiting_connack = False  # an attempt of _connect_once waits for its CONNACK
        self._lost_before_connack: str | None = None  # why the connection ended before it
        self._last_info: paho.MQTTMessageInfo | None = None
        self._client = self._make_client(username, password, tls, max_inflight)

    @property
    def where(self) -> str:
        """The broker's URL over WebSockets (``wss://host:port/path``), else ``host:port``."""
        if self.websocket_path is None:
            return super().where
        scheme = "wss" if self._tls else "ws"
        return f"{scheme}://{super().where}{self.websocket_path}"

    def _make_client(
        self, username: str | None, password: str | None, tls: TlsOptions | None, max_inflight: int
    ) -> paho.Client:
        transport: Literal["tcp", "websockets"] = "tcp"
        if self.websocket_path is not None:
            transport = "websockets"
        if self.protocol == "5":
            client = paho.Client(
                CallbackAPIVersion.VERSION2,
                client_id=self.client_id,
                protocol=paho.MQTTv5,
                transport=transport,
            )
        else:
            client = paho.Client(
                CallbackAPIVersion.VERSION2,
                client_id=self.client_id,
                clean_session=self.clean_session,
                protocol=paho.MQTTv311,
                transport=transport,
            )
        if self.websocket_path is not None:
            client.ws_set_options(path=self.websocket_path)
        client.connect_timeout = self.connect_timeout
        client.max_inflight_messages_set(max_inflight)
        client.max_queued_messages_set(0)  # unbounded: QoS 1 messages wait out a reconnect
        if username is not None:
            client.username_pw_set(username, password)
        if tls is not None:
            client.tls_set(
                ca_certs=tls.ca_certs,
                certfile=tls.certfile,
                keyfile=tls.keyfile,
                cert_reqs=ssl.CERT_REQUIRED,
                tls_version=ssl.PROTOCOL_TLS_CLIENT,
            )
            client.tls_insecure_set(tls.insecure)
        if self.will is not None:
            client.will_set(
                self.will.topic, self.will.payload, qos=self.will.qos, retain=self.will.retain
            )
        client.on_socket_open = self._on_socket_open
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_subscribe = self._on_subscribe
        return client

    # -- lifecycle -------------------------------------------------------------------------

    def _connect_once(self) -> None:
        if self._started:
            raise TransportError(f"mqtt {self.client_id}: connect() called twice")
        self._connack.clear()
        self._connack_error = self._lost_before_connack = None
        self._awaiting_connack = True
        # paho tells why a read failed (a TLS alert) only in its log: listened to during the
        # attempt alone, as formatting every packet's log line would cost all the time after
        self._client.on_log = self._on_attempt_log
        try:
            self._try_connect()
        finally:
            self._awaiting_connack = False
            self._client.on_log = None

    def _try_connect(self) -> None:
        deadline = time.monotonic() + self.connect_timeout
        kwargs: dict[str, Any] = {}
        if self.protocol == "5":
            props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
            props.SessionExpiryInterval = 0 if self.clean_session else self.session_expiry
            kwargs = {"clean_start": self.clean_session, "properties": props}
        try:
            self._client.connect(self.host, self.port, keepalive=self.keepalive, **kwargs)
        except (OSError, ValueError) as exc:  # refused, timed out, DNS failure, bad host
            if self._tls and ended_by_tls_peer(exc):  # a TLS 1.2 handshake fails right here
                raise tls_refusal(self.where, exc) from exc
            raise ConnectError(f"cannot reach MQTT broker at {self.where}: {exc}") from exc
        self._started = True
        self._client.loop_start()
        if not self._connack.wait(max(0.0, deadline - time.monotonic())):
            self._abandon()
            raise ConnectError(
                f"cannot reach MQTT broker at {self.where}: no CONNACK within "
                f"{self.connect_timeout:g} s (is it an MQTT broker?)"
            )
        lost = self._lost_before_connack
        if lost is not None:
            self._abandon()
            if self._tls:  # TLS 1.3: the broker's verdict on our certificate comes now
                raise tls_refusal(self.where, lost)
            raise ConnectError(
                f"cannot reach MQTT broker at {self.where}: it closed the connection before a "
                f"CONNACK ({lost}; is it an MQTT broker?)"
            )
        if self._connack_error is not None:
            self._abandon()
            raise SessionRefusedError(
                f"MQTT broker at {self.where} refused the session: {self._connack_error}"
            )

    def close(self) -> None:
        """Flush queued QoS 1 messages (up to ``flush_timeout``), then disconnect cleanly.

        A clean disconnect does not trigger the last will. Idempotent.
        """
        if not self._started:
            return
        info = self._last_info
        if info is not None and self._connected:
            # RuntimeError/ValueError: it was never queued, so there is nothing to wait for
            with contextlib.suppress(RuntimeError, ValueError):
                info.wait_for_publish(self.flush_timeout)
        self._closing = True
        self._client.disconnect()
        self._client.loop_stop()
        self._started = False
        self._connected = False

    def abort(self) -> None:
        """Drop the TCP connection without DISCONNECT, as a crash would (tests, simulations).

        The broker then publishes the last will. The transport cannot be reused afterwards.
        """
        if not self._started:
            return
        self._closing = self._aborting = True
        sock = self._client.socket()
        if sock is not None:
            with contextlib.suppress(OSError), _descriptor(sock) as raw:
                raw.shutdown(socket.SHUT_RDWR)
        self._client.loop_stop()
        self._started = False
        self._connected = False

    def _abandon(self) -> None:
        self._closing = True
        self._client.disconnect()
        self._client.loop_stop()
        self._started = False

    # -- publish / subscribe ---------------------------------------------------------------

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        """Queue ``payload`` for ``topic``.

        QoS 1 messages published while the connection is down are kept and sent after the
        reconnect; QoS 0 messages cannot be kept and raise.

        Raises:
            TransportError: the transport is closed, the message exceeds the broker's maximum
                packet size, or paho could not queue it (QoS 0 while disconnected, bad topic).
        """
        if not self._started:
            raise TransportError(
                f"publish to {topic}: mqtt transport {self.client_id} is not connected"
            )
        limit = self.max_packet_size
        if limit is not None and len(payload) + len(topic.encode()) + 16 > limit:
            raise TransportError(
                f"publish to {topic}: {len(payload)} bytes exceed the broker's maximum packet "
                f"size of {limit} bytes"
            )
        try:
            info = self._client.publish(topic, payload, qos=qos, retain=retain)
        except ValueError as exc:  # invalid topic, QoS or payload size
            raise TransportError(f"publish to {topic}: {exc}") from exc
        rc = info.rc
        if rc == MQTTErrorCode.MQTT_ERR_NO_CONN and qos > 0:
            rc = MQTTErrorCode.MQTT_ERR_SUCCESS  # paho keeps it and sends it after reconnecting
        if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            raise TransportError(
                f"publish to {topic} ({len(payload)} bytes, qos {qos}) was not queued: "
                f"{paho.error_string(rc)}"
            )
        if qos > 0:
            self._last_info = info

    def subscribe(self, topic_filter: str, handler: Handler, qos: int = 1) -> None:
        """Deliver messages matching ``topic_filter`` to ``handler``, now and after reconnects.

        When connected, and not called from a handler, this waits for the broker's SUBACK, so
        that messages published after it returns are delivered.

        Raises:
            TransportError: invalid filter or QoS, or the broker refused the subscription.
        """
        if not topic_filter or qos not in (0, 1, 2):
            raise TransportError(f"subscribe: invalid filter {topic_filter!r} or qos {qos!r}")
        with self._lock:
            self._subs.append((topic_filter, handler, qos))
            self._routes.add(topic_filter, handler)
        if self._connected:
            self._send_subscribe(
                [(topic_filter, qos)], wait=threading.get_ident() != self._loop_ident
            )

    def _send_subscribe(self, filters: list[tuple[str, int]], *, wait: bool) -> None:
        event = threading.Event()
        failures: list[str] = []
        with self._lock:  # register before sending: the SUBACK may beat the bookkeeping
            rc, mid = self._client.subscribe(filters)
            if rc == MQTTErrorCode.MQTT_ERR_SUCCESS and mid is not None:
                self._suback[mid] = (event, failures)
        if rc == MQTTErrorCode.MQTT_ERR_NO_CONN:
            return  # on_connect subscribes again
        if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            raise TransportError(f"subscribe {filters}: {paho.error_string(rc)}")
        if wait and event.wait(self.connect_timeout) and failures:
            raise TransportError(f"broker at {self.where} refused subscription(s): {failures}")

    # -- paho callbacks (network thread) ---------------------------------------------------

    def _on_socket_open(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        # Without TCP_NODELAY, Nagle + delayed ACK stall every QoS 1 round trip by ~40-90 ms.
        try:
            with _descriptor(sock) as raw:
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, AttributeError) as exc:
            self.log.debug("TCP_NODELAY not set: %s", exc)

    def _on_connect(
        self, client: paho.Client, userdata: Any, flags: Any, reason: Any, properties: Any
    ) -> None:
        self._loop_ident = threading.get_ident()
        if reason.is_failure:
            self._connack_error = str(reason)
            self.log.error("broker at %s refused the session: %s", self.where, reason)
            self._connack.set()
            return
        self.session_present = bool(getattr(flags, "session_present", False))
        size = getattr(properties, "MaximumPacketSize", None) if self.protocol == "5" else None
        self.max_packet_size = int(size) if size else None
        self._attempt = 0
        self.log.info("connected to %s (session present: %s)", self.where, self.session_present)
        with self._lock:
            best: dict[str, int] = {}
            for topic_filter, _handler, qos in self._subs:
                best[topic_filter] = max(qos, best.get(topic_filter, 0))
            known = len(self._subs)
        if best:  # a broker without our session (restarted, expired) needs them again
            self._send_subscribe(sorted(best.items()), wait=False)
        # `connected` only once the subscriptions are queued, as the lean client does: a
        # message published after it is seen then goes out after them. A filter subscribed
        # meanwhile saw us disconnected and did not send itself: it goes now
        with self._lock:
            self._connected = True
            late = [(topic_filter, qos) for topic_filter, _handler, qos in self._subs[known:]]
        if late:
            self._send_subscribe(late, wait=False)
        self._connack.set()
        self._notify_connect(self.session_present)

    def _on_attempt_log(self, client: paho.Client, userdata: Any, level: int, buf: str) -> None:
        if level == paho.MQTT_LOG_ERR and self._lost_before_connack is None:
            self._lost_before_connack = buf  # the first: e.g. the TLS alert a read failed with

    def _on_disconnect(
        self, client: paho.Client, userdata: Any, flags: Any, reason: Any, properties: Any
    ) -> None:
        self._connected = False
        if self._awaiting_connack and not self._connack.is_set():
            # the connection ended before its CONNACK: the attempt ends, with paho's reason
            self._lost_before_connack = self._lost_before_connack or str(reason)
            self._connack.set()
            return
        if self._aborting:
            client.disconnect()  # marks the state so paho's loop ends instead of reconnecting
            return
        if self._closing:
            self.log.info("disconnected from %s", self.where)
            return
        delay = self._next_delay()
        self.log.warning(
            "lost connection to %s (%s); reconnecting in %.2f s", self.where, reason, delay
        )

    def _on_connect_fail(self, client: paho.Client, userdata: Any) -> None:
        delay = self._next_delay()
        self.log.info("broker at %s unreachable; retrying in %.2f s", self.where, delay)

    def _next_delay(self) -> float:
        delay = super()._next_delay()
        # paho waits exactly min_delay after reconnect_delay_set (it resets its own doubling)
        self._client.reconnect_delay_set(delay, delay)  # type: ignore[arg-type]
        return delay

    def _on_subscribe(
        self, client: paho.Client, userdata: Any, mid: int, reasons: list[Any], properties: Any
    ) -> None:
        with self._lock:
            entry = self._suback.pop(mid, None)
        if entry is None:
            return
        event, failures = entry
        failures.extend(str(r) for r in reasons if r.is_failure)
        if failures:
            self.log.error(
                "broker at %s refused subscription (mid %d): %s", self.where, mid, failures
            )
        event.set()

    def _on_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        self._loop_ident = threading.get_ident()
        topic, payload = msg.topic, bytes(msg.payload)
        for handler in self._routes.handlers(topic):
            try:
                handler(topic, payload)
            except Exception:  # a failing handler must not kill paho's network thread
                self.log.exception("handler for %s failed", topic)


def _descriptor(sock: Any) -> socket.socket:
    """A duplicate of the descriptor under paho's socket, plain, TLS or WebSocket (whose
    wrapper has no socket methods): options and a shutdown set on it reach the connection
    itself, while closing it closes the duplicate only."""
    return socket.fromfd(sock.fileno(), socket.AF_INET, socket.SOCK_STREAM)
