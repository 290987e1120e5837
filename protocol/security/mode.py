"""The security mode a broker client runs in, decided once at start-up, before it connects.

Secure by default: ``coordinator serve``, ``coordinator ingest-worker`` and ``edge-agent``
connect to a broker only with TLS client authentication (a client certificate) and signed
frames, unless the broker is on this machine (a loopback address: nobody else can reach the
connection) or ``--insecure`` says that an unauthenticated fleet is meant. Each says at
start-up, in one line, which mode it runs in and why. MQTT over WebSockets is judged as MQTT
over TCP: ``ws://`` is plain (refused with TLS credentials, which would not be used), ``wss://``
is TLS, and secure only with a client certificate.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from typing import Literal

from protocol.errors import ConfigError
from protocol.security.credentials import ENV, Credentials
from protocol.transport.address import BrokerAddress

__all__ = ["SecurityMode", "connection_mode", "is_loopback"]

ModeName = Literal["secure", "loopback", "insecure", "in-process"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only: ``localhost``, 127.0.0.0/8 or ``::1`` (a name
    is not resolved: it may resolve to anything)."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class SecurityMode:
    """Which mode a command runs in, and why (its start-up line)."""

    name: ModeName
    reason: str

    @property
    def line(self) -> str:
        """The start-up line: ``security: MODE (WHY)``."""
        return f"security: {self.name} ({self.reason})"

    def announce(self, log: logging.Logger) -> None:
        """Log :attr:`line`, as a warning when anyone on the network can read and forge."""
        log.log(logging.WARNING if self.name == "insecure" else logging.INFO, "%s", self.line)


def connection_mode(
    broker: BrokerAddress,
    creds: Credentials,
    *,
    signing: bool,
    insecure: bool,
    what: str = "broker",
) -> SecurityMode:
    """The mode of a connection to ``broker`` with ``creds``; ``signing``: frames are signed
    and verified. ``what`` names the connection in the messages.

    Raises:
        ConfigError: a plain scheme (``mqtt://``, ``ws://``) with TLS credentials; or the
            broker's host is not a loopback address, TLS client authentication or signing is
            missing, and ``insecure`` is false; the message names the flags that fix it.
    """
    broker.check_tls(creds.tls)
    host = broker.host if broker.scheme is None else str(broker)  # a URL says its transport
    missing = _missing(creds, signing)
    if not missing:
        return SecurityMode("secure", f"TLS client certificate, signed frames; {creds.describe()}")
    lacks = " and ".join(missing)
    if is_loopback(broker.host):
        return SecurityMode("loopback", f"{what} {host} is on this machine; without {lacks}")
    if insecure:
        return SecurityMode(
            "insecure",
            f"--insecure: {what} {host} without {lacks}; anyone who reaches it can read and "
            "forge every message",
        )
    raise ConfigError(
        f"refusing to connect to the {what} at {host} without {lacks}: give the fleet's kit "
        "(--kit DIR, from `coordinator provision`), or TLS files and signing keys (--credentials "
        f"FILE with [tls] ca/cert/key and [signing] key/verify_keys, or ${ENV['ca']}, "
        f"${ENV['cert']}, ${ENV['key']}, ${ENV['signing_key']}, ${ENV['verify_keys']}); "
        "or --insecure to run without them, readable and forgeable by anyone who reaches the "
        f"{what}"
    )


def _missing(creds: Credentials, signing: bool) -> list[str]:
    """What a secure connection lacks, in words."""
    missing = []
    if creds.cert is None or not creds.tls:
        missing.append("TLS client authentication")
    if not signing:
        off = creds.signing_key is not None  # keys there, turned off
        missing.append("signing (--no-signing)" if off else "signing")
    return missing
