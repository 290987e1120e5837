"""MQTT over WebSockets against real brokers: the embedded broker's ``ws_port`` listener, and the
provisioned fleet's WebSockets-over-TLS listener (``provision --ws-port``) on Mosquitto and on
the embedded broker, with the fleet's mutual TLS."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import Inbox, unique_id

from coordinator.broker.embedded import BrokerFiles, EmbeddedBroker
from coordinator.config import RunConfig
from protocol.contract.codec import Envelope, decode, encode
from protocol.contract.messages import Ack, Status
from protocol.contract.topics import Topics
from protocol.errors import ConfigError, ConnectError
from protocol.security.credentials import Credentials
from protocol.transport.base import TlsOptions, Will
from protocol.transport.endpoint import Endpoint
from protocol.transport.lean_mqtt import LeanMqttTransport
from protocol.transport.paho import MqttTransport
from tests.conftest import ProvisionedBroker, provisioned_fleet

T = Topics("fed")


def _kit_tls(kit: Path, name: str = "device") -> TlsOptions:
    return TlsOptions(
        ca_certs=str(kit / "ca.crt"),
        certfile=str(kit / f"{name}.crt"),
        keyfile=str(kit / f"{name}.key"),
    )


@pytest.mark.network
def test_a_websockets_client_and_a_tcp_client_share_the_embedded_broker() -> None:
    """An agent over ``ws://`` and a coordinator over TCP (the lean client) exchange messages
    through one broker; the agent's dropped WebSocket connection publishes its last will."""
    status = encode(Envelope(body=Status(state="offline"), sender="dev1", federation="fed"))
    with EmbeddedBroker(ws_port=0) as broker:
        assert broker.ws_port not in (None, 0, broker.port)
        agent_t = MqttTransport(
            client_id=unique_id("dev1"),
            port=broker.ws_port or 0,
            websocket_path="/mqtt",
            will=Will(T.status("dev1"), status),
        )
        coord_t = LeanMqttTransport(client_id=unique_id("coord"), port=broker.port)
        agent_t.connect()
        coord_t.connect()
        try:
            agent = Endpoint(agent_t, sender="dev1", federation="fed")
            coord = Endpoint(coord_t, sender="coord", federation="fed")
            at_agent, wills = Inbox(), Inbox()
            agent.subscribe(T.down("dev1", "#"), at_agent)
            coord_t.subscribe(T.status("dev1"), lambda topic, data: wills(data, topic))
            coord.send(T.down("dev1", "ack"), Ack(ref_id="m1"))
            assert at_agent.wait(1, timeout=30)
            agent_t.abort()  # a crash: the broker publishes the will
            assert wills.wait(1, timeout=30)
        finally:
            agent_t.close()
            coord_t.close()
    assert agent_t.where == f"ws://127.0.0.1:{broker.ws_port}/mqtt"
    assert at_agent.items[0][0].body == Ack(ref_id="m1")
    assert decode(wills.items[0][0]).body == Status(state="offline")


@pytest.mark.network
def test_the_fleets_websockets_listener_takes_its_certificates_only(
    wss_broker: ProvisionedBroker,
) -> None:
    """``wss://`` with the kit's mutual TLS, exactly as the TLS listener: a device with its
    certificate gets in and reaches its own topics; without a certificate, or with plain
    WebSockets, a client is refused."""
    port = wss_broker.ws_port
    assert port is not None
    kit = wss_broker.kit("agent0")
    ca = str(kit / "ca.crt")
    got = Inbox()
    device = MqttTransport(
        client_id="edgefl-tls-agent0", port=port, websocket_path="/mqtt", tls=_kit_tls(kit)
    )
    coordinator = MqttTransport(
        client_id=unique_id("coord"),
        port=port,
        websocket_path="/mqtt",
        tls=_kit_tls(wss_broker.kit("coordinator"), "coordinator"),
    )
    base = "edgefl/v1/tls"
    try:
        device.connect()
        coordinator.connect()
        device.subscribe(f"{base}/dev/agent0/down/#", lambda topic, data: got(data, topic))
        coordinator.publish(f"{base}/dev/agent0/down/task", b"over wss")
        assert got.wait(1, timeout=30)
    finally:
        device.close()
        coordinator.close()
    assert got.items[0][0] == b"over wss"
    for intruder in (TlsOptions(ca_certs=ca), None):  # no certificate; no TLS at all
        t = MqttTransport(
            client_id="intruder", port=port, websocket_path="/mqtt", tls=intruder, connect_timeout=5
        )
        with pytest.raises(ConnectError):
            t.connect()
        t.close()


def test_the_broker_directory_names_its_websockets_listener() -> None:
    pytest.importorskip("cryptography")
    with provisioned_fleet(websockets=True) as root:
        files = BrokerFiles.open(root / "broker")
        tls_port, host = files.listener()
        ws_port = files.websocket_port()
    assert host == "127.0.0.1" and ws_port is not None and ws_port != tls_port
    with provisioned_fleet() as root:
        assert BrokerFiles.open(root / "broker").websocket_port() is None


def test_serve_refuses_a_websockets_port_for_a_broker_it_does_not_run() -> None:
    from coordinator.commands.serve import _serve_run

    cfg = RunConfig(broker="broker.example:8883")
    with pytest.raises(ConfigError, match="--ws-port 9001 is a listener of the embedded broker"):
        _serve_run(cfg, Credentials(), None, ws_port=9001)
