"""Broker addresses: the bare ``host[:port]`` form and the ``mqtt``, ``mqtts``, ``ws``, ``wss``
URLs; what each asks of the MQTT client; the refusals."""

from __future__ import annotations

import pytest

from protocol.errors import ConfigError
from protocol.transport.address import BrokerAddress, parse_broker
from protocol.transport.base import TlsOptions

KIT_TLS = TlsOptions(ca_certs="ca.crt", certfile="dev.crt", keyfile="dev.key")


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("broker.local", BrokerAddress("broker.local", 1883)),
        ("10.0.0.2:8883", BrokerAddress("10.0.0.2", 8883)),
        ("[::1]:1884", BrokerAddress("::1", 1884)),
        ("::1", BrokerAddress("::1", 1883)),
        (" host:1 ", BrokerAddress("host", 1)),
        ("mqtt://broker.local", BrokerAddress("broker.local", 1883, "mqtt")),
        ("MQTTS://broker.local:8884", BrokerAddress("broker.local", 8884, "mqtts")),
        ("mqtts://broker.local", BrokerAddress("broker.local", 8883, "mqtts")),
        ("ws://broker.local", BrokerAddress("broker.local", 80, "ws", "/mqtt")),
        ("ws://127.0.0.1:9001/", BrokerAddress("127.0.0.1", 9001, "ws", "/")),
        ("wss://broker.local", BrokerAddress("broker.local", 443, "wss", "/mqtt")),
        ("wss://[::1]:8443/edge/mqtt", BrokerAddress("::1", 8443, "wss", "/edge/mqtt")),
    ],
)
def test_parse_broker(address: str, expected: BrokerAddress) -> None:
    assert parse_broker(address) == expected


@pytest.mark.parametrize(
    ("address", "match"),
    [
        ("", "expected 'host\\[:port\\]'"),
        ("host:abc", "port: expected an int in 1..65535, got 'abc'"),
        ("host:70000", "1..65535"),
        (":1883", "empty host"),
        ("wss://:443", "empty host"),
        ("[::1", "ipv6"),
        ("[not-ip]:1883", "bad IPv6 address"),
        ("host/mqtt", "a path needs a ws:// or wss:// URL"),
        ("http://host:80", "unknown scheme 'http'"),
        ("tcp://host", "unknown scheme 'tcp'"),
        ("mqtt://host:1883/x", "mqtt:// takes no path"),
        ("mqtts://host/", "mqtts:// takes no path"),
        ("ws://host/mqtt?token=1", "a query is not allowed"),
        ("wss://host/mqtt#frag", "a fragment is not allowed"),
        ("wss://user:secret@host/mqtt", "user info is not allowed.*--credentials"),
        ("ws://host/a b", "bad WebSocket path"),
        ("ws://bad host/mqtt", "bad host name"),
        ("wss://host:0/mqtt", "1..65535"),
    ],
)
def test_parse_broker_errors(address: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_broker(address)


def test_an_address_prints_as_it_connects() -> None:
    assert str(parse_broker("wss://[::1]/m")) == "wss://[::1]:443/m"
    assert str(parse_broker("broker.local")) == "broker.local:1883"
    assert str(parse_broker("[::1]:2")) == "[::1]:2"
    assert parse_broker(str(parse_broker("ws://h:1/p"))) == parse_broker("ws://h:1/p")


def test_client_options_follow_the_scheme() -> None:
    creds = {"username": "u", "password": "p", "tls": KIT_TLS}
    # the bare form: TLS as the credentials say, as always
    assert parse_broker("h:1").client_options(creds) == {**creds, "host": "h", "port": 1}
    assert parse_broker("h").client_options({"tls": None}) == {
        "tls": None,
        "host": "h",
        "port": 1883,
    }
    # wss: the kit's mutual TLS exactly as on TCP, and the WebSocket path
    assert parse_broker("wss://h/ws").client_options(creds) == {
        **creds, "host": "h", "port": 443, "websocket_path": "/ws",
    }  # fmt: skip
    # mqtts/wss without a CA bundle: TLS all the same, the broker checked with the system's CAs
    for url in ("mqtts://h", "wss://h"):
        assert parse_broker(url).client_options({"tls": None})["tls"] == TlsOptions()
    # plain schemes stay plain; with TLS credentials they are refused, never silently downgraded
    assert parse_broker("ws://h").client_options({"tls": None})["tls"] is None
    assert "websocket_path" not in parse_broker("mqtt://h").client_options({})
    for url, secure in (("ws://h:9/p", "wss://h:9/p"), ("mqtt://h", "mqtts://h:1883")):
        with pytest.raises(ConfigError, match=f"plain connection.*use {secure}"):
            parse_broker(url).client_options(creds)
