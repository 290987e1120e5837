"""What the two MQTT clients share: their settings, the reconnect backoff, connect with retry.

:class:`~protocol.transport.paho.MqttTransport` (paho-mqtt, the devices') and
:class:`~protocol.transport.lean_mqtt.LeanMqttTransport` (the coordinator's own socket client)
differ in
how they speak MQTT, not in how they treat an unreachable or refusing broker: that policy
(``WIRE.md`` §1) lives here once.
"""

from __future__ import annotations

import logging
import random
import ssl
import time
from abc import abstractmethod

from protocol.errors import ConfigError, ConnectError
from protocol.transport.base import Transport, Will

__all__ = ["MqttClient", "SessionRefusedError", "ended_by_tls_peer", "tls_refusal"]


class SessionRefusedError(ConnectError):
    """The broker answered but refused the session (credentials, client id): never retried."""


def ended_by_tls_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is the broker ending a TLS handshake (an alert, a reset, an early end of
    the stream), not this client rejecting the broker's own certificate."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return False
    return isinstance(exc, (ssl.SSLError, ConnectionResetError, BrokenPipeError))


def tls_refusal(where: str, detail: object) -> ConnectError:
    """The error of a TLS connection the broker closed before its CONNACK.

    A broker that refuses a client's certificate (revoked by its CRL, expired, of another CA)
    ends the handshake; with TLS 1.3 the client learns it only once it waits for the CONNACK,
    where a missing CONNACK otherwise suggests that the port is not an MQTT broker at all."""
    return ConnectError(
        f"MQTT broker at {where} closed the TLS connection during the handshake ({detail}): "
        "is this client's certificate revoked, expired or from another CA?"
    )


class MqttClient(Transport):
    """An MQTT client's identity, broker address and reconnect policy.

    Subclasses implement :meth:`_connect_once` (one attempt, blocking until the broker accepted
    the session) and set ``_connected``.
    """

    def __init__(
        self,
        *,
        client_id: str,
        host: str,
        port: int,
        will: Will | None,
        keepalive: int,
        clean_session: bool,
        connect_timeout: float,
        reconnect_min: float,
        reconnect_max: float,
        flush_timeout: float,
        logger: logging.Logger | None,
    ) -> None:
        if not client_id:
            raise ConfigError("client_id: expected a non-empty string, got ''")
        if not 0 < reconnect_min <= reconnect_max:
            raise ConfigError(
                "reconnect delays: expected 0 < min <= max, got "
                f"min={reconnect_min}, max={reconnect_max}"
            )
        super().__init__()
        self.client_id, self.host, self.port, self.will = client_id, host, port, will
        self.keepalive, self.clean_session = keepalive, clean_session
        self.connect_timeout, self.flush_timeout = connect_timeout, flush_timeout
        self.reconnect_min, self.reconnect_max = reconnect_min, reconnect_max
        self.session_present = False
        self.log = logger or logging.getLogger(f"edgefl.mqtt.{client_id}")
        self._connected = False
        self._attempt = 0

    @property
    def connected(self) -> bool:
        """Whether the client currently holds an accepted session with the broker."""
        return self._connected

    @property
    def where(self) -> str:
        """``host:port`` of the broker, for messages."""
        return f"{self.host}:{self.port}"

    def connect(self, retry_for: float = 0.0) -> None:
        """Connect and block until the broker accepts the session.

        ``retry_for`` > 0 keeps trying an unreachable broker for that many seconds, with the
        jittered backoff of reconnects: a device that boots before its broker waits for it.
        A broker that refuses the session (bad credentials) is not retried.

        Raises:
            ConnectError: the broker is unreachable (still, after ``retry_for``), refuses the
                session, or sends no CONNACK within ``connect_timeout`` seconds.
        """
        end = time.monotonic() + retry_for
        while True:
            try:
                self._connect_once()
                return
            except SessionRefusedError:
                raise
            except ConnectError:
                if time.monotonic() >= end:
                    raise
            delay = min(self._next_delay(), max(0.0, end - time.monotonic()))
            self.log.warning(
                "broker at %s unreachable; retrying in %.1f s (for %.0f s more)",
                self.where,
                delay,
                end - time.monotonic(),
            )
            time.sleep(delay)

    @abstractmethod
    def _connect_once(self) -> None:
        """One attempt; raises :class:`ConnectError` (:class:`SessionRefusedError` when the
        broker refused the session)."""

    def _next_delay(self) -> float:
        """Capped exponential backoff with jitter in [d/2, d] (spreads a fleet's reconnects)."""
        cap = min(self.reconnect_max, self.reconnect_min * 2.0 ** min(self._attempt, 30))
        self._attempt += 1
        return cap / 2 + random.uniform(0.0, cap / 2)
