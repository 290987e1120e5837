"""Broker addresses: ``host[:port]`` or a URL, ``mqtt://``, ``mqtts://``, ``ws://``, ``wss://``.

The bare form leaves TLS to the credentials (a CA bundle turns it on), as it always did. A URL
says the transport itself: ``mqtt://`` plain TCP, ``mqtts://`` TLS over TCP, ``ws://`` MQTT
over WebSockets, ``wss://`` MQTT over WebSockets over TLS (for devices behind firewalls that
pass HTTPS only). A scheme that contradicts the credentials (``ws://`` with a TLS kit) is a
:class:`~protocol.errors.ConfigError`: a plain connection must never pass for a secured one.

This module imports no MQTT client: commands parse and check an address before they load one.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any, Literal

from protocol.errors import ConfigError
from protocol.transport.base import TlsOptions

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_PORTS",
    "DEFAULT_WS_PATH",
    "BrokerAddress",
    "Scheme",
    "parse_broker",
]

Scheme = Literal["mqtt", "mqtts", "ws", "wss"]
DEFAULT_PORT = 1883  # of the bare form, whatever the credentials
DEFAULT_PORTS: dict[Scheme, int] = {"mqtt": 1883, "mqtts": 8883, "ws": 80, "wss": 443}
DEFAULT_WS_PATH = "/mqtt"  # Mosquitto, HiveMQ, EMQX and paho's own default
_TLS_OF: dict[Scheme, Scheme] = {"mqtt": "mqtts", "ws": "wss"}
_FORMS = "'host[:port]', mqtt://, mqtts://, ws:// or wss://host[:port][/path]"
_HOST = re.compile(r"[A-Za-z0-9._-]+")
# RFC 3986 path characters: no query, fragment, space or control character reaches the request
_PATH = re.compile(r"/[A-Za-z0-9._~!$&'()*+,;=:@%/-]*")


@dataclass(frozen=True, slots=True)
class BrokerAddress:
    """Where an MQTT client connects, and over what.

    ``scheme`` is ``None`` for the bare ``host[:port]`` form (TLS as the credentials say);
    ``path`` is the WebSocket request path of ``ws``/``wss`` and empty otherwise.
    """

    host: str
    port: int
    scheme: Scheme | None = None
    path: str = ""

    @property
    def websockets(self) -> bool:
        """Whether MQTT travels over WebSockets (``ws://``, ``wss://``)."""
        return self.scheme in ("ws", "wss")

    @property
    def tls(self) -> bool | None:
        """What the scheme says of TLS: on (``mqtts``, ``wss``), off (``mqtt``, ``ws``), or
        ``None`` (bare form: the credentials decide)."""
        if self.scheme is None:
            return None
        return self.scheme in ("mqtts", "wss")

    @property
    def netloc(self) -> str:
        """``host:port``, an IPv6 host in brackets."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def __str__(self) -> str:
        if self.scheme is None:
            return self.netloc
        return f"{self.scheme}://{self.netloc}{self.path}"

    def check_tls(self, credentials_tls: bool) -> None:
        """Refuse a plain scheme (``mqtt://``, ``ws://``) with credentials that give TLS files:
        the connection would be plain while the kit's certificates suggest a secured one.

        Raises:
            ConfigError: naming the scheme to use instead.
        """
        if credentials_tls and self.scheme in _TLS_OF:
            secure = _TLS_OF[self.scheme]
            raise ConfigError(
                f"broker {self}: {self.scheme}:// is a plain connection, but the credentials "
                f"give TLS files (a kit, [tls] or $EDGEFL_TLS_CA); use {secure}://"
                f"{self.netloc}{self.path} (or {self.netloc}) for TLS"
            )

    def client_options(self, credentials: dict[str, Any]) -> dict[str, Any]:
        """Keyword arguments of an MQTT client for this address: ``host``, ``port``,
        ``websocket_path`` (WebSockets only) and ``credentials``
        (:meth:`~protocol.security.credentials.Credentials.transport_options`), TLS as the
        scheme says: ``mqtts``/``wss`` without a CA bundle verify the broker with the
        system's CAs.

        Raises:
            ConfigError: a plain scheme with TLS credentials (:meth:`check_tls`).
        """
        options = dict(credentials)
        self.check_tls(options.get("tls") is not None)
        if self.tls and options.get("tls") is None:
            options["tls"] = TlsOptions()
        options.update(host=self.host, port=self.port)
        if self.websockets:
            options["websocket_path"] = self.path
        return options


def parse_broker(address: str, default_port: int = DEFAULT_PORT) -> BrokerAddress:
    """Parse ``"host[:port]"`` (IPv6 as ``"[::1]:1883"``) or a broker URL
    (``"wss://broker.example:443/mqtt"``); a URL's port defaults to its scheme's
    (:data:`DEFAULT_PORTS`), a WebSocket path to ``/mqtt``.

    Raises:
        ConfigError: empty or malformed host, an unknown scheme, user info, a query or
            fragment, a path on ``mqtt``/``mqtts`` or one that is not a plain URL path, an
            unbracketed IPv6 address with a port, or a port that is not an int in 1..65535.
    """
    text = address.strip() if isinstance(address, str) else ""
    if not text:
        raise ConfigError(f"broker address: expected {_FORMS}, got {address!r}")
    scheme_text, sep, rest = text.partition("://")
    if not sep:
        if "/" in text:
            raise ConfigError(
                f"broker address: expected {_FORMS}; a path needs a ws:// or wss:// URL, "
                f"got {address!r}"
            )
        return _netloc(text, address, default_port, None)
    scheme = scheme_text.lower()
    if scheme not in DEFAULT_PORTS:
        raise ConfigError(
            f"broker address: unknown scheme {scheme_text!r} in {address!r}; expected {_FORMS}"
        )
    known = scheme
    for mark, what in (("?", "a query"), ("#", "a fragment"), ("@", "user info")):
        if mark in rest:
            why = " (credentials go in --credentials or $EDGEFL_*)" if mark == "@" else ""
            raise ConfigError(f"broker address: {what} is not allowed in {address!r}{why}")
    netloc, slash, path = rest.partition("/")
    path = slash + path
    if known in ("ws", "wss"):
        path = path or DEFAULT_WS_PATH
        if not _PATH.fullmatch(path):
            raise ConfigError(f"broker address: bad WebSocket path {path!r} in {address!r}")
    elif path:
        raise ConfigError(
            f"broker address: {known}:// takes no path, got {path!r} in {address!r} (a path is "
            "for ws:// and wss://)"
        )
    return _netloc(netloc, address, DEFAULT_PORTS[known], known, path)


def _netloc(
    text: str, address: str, default_port: int, scheme: Scheme | None, path: str = ""
) -> BrokerAddress:
    """``host[:port]`` of ``address`` (for messages) into an address."""
    port_text: str | None = None
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ConfigError(f"broker address: expected '[ipv6]:port', got {address!r}")
        port_text = rest[1:] if rest else None
        _check_ipv6(host, address)
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif ":" in text:
        host = text  # a bare IPv6 address; a port needs brackets
        _check_ipv6(host, address)
    else:
        host = text
    if not host:
        raise ConfigError(f"broker address: empty host in {address!r}")
    if ":" not in host and not _HOST.fullmatch(host):
        raise ConfigError(f"broker address: bad host name {host!r} in {address!r}")
    port = default_port
    if port_text is not None:
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise ConfigError(
                f"broker port: expected an int in 1..65535, got {port_text!r} in {address!r}"
            )
        port = int(port_text)
    return BrokerAddress(host, port, scheme, path)


def _check_ipv6(host: str, address: str) -> None:
    try:
        ipaddress.IPv6Address(host)
    except ValueError as exc:
        raise ConfigError(f"broker address: bad IPv6 address {host!r} in {address!r}") from exc
