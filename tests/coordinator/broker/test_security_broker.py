"""The embedded broker, which has no authentication, listens on the
loopback interface unless told otherwise, and says so loudly when told otherwise."""

from __future__ import annotations

import logging
import socket

import pytest

from coordinator.broker.embedded import EmbeddedBroker
from protocol.security.mode import is_loopback


def _lan_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: only picks the route
            addr: str = s.getsockname()[0]
        except OSError:
            return None
    return None if is_loopback(addr) else addr


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def test_loopback_hosts_are_recognised() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "", "::", "192.168.1.5"))


@pytest.mark.network
def test_embedded_broker_is_not_reachable_from_the_network_by_default(
    embedded_broker: EmbeddedBroker,
) -> None:
    assert embedded_broker.host == "127.0.0.1"
    assert _reachable("127.0.0.1", embedded_broker.port)
    lan = _lan_address()
    if lan is None:
        pytest.skip("this host has no non-loopback IPv4 address to probe from")
    assert not _reachable(lan, embedded_broker.port)


@pytest.mark.network
def test_listening_on_every_interface_is_explicit_and_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="edgefl.broker"),
        EmbeddedBroker(host="0.0.0.0") as broker,
    ):
        assert _reachable("127.0.0.1", broker.port)
    assert "without authentication" in caplog.text
