"""The brokers edgefl can start itself: embedded amqtt and a local mosquitto."""

from __future__ import annotations

import sys

import pytest
from helpers import Inbox, free_port

from coordinator.broker.embedded import EmbeddedBroker, MosquittoBroker, SnapshotDict
from protocol.errors import EdgeFLError
from protocol.transport.paho import MqttTransport


def test_missing_amqtt_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "amqtt.broker", None)  # makes the import fail
    with pytest.raises(EdgeFLError, match=r"pip install edgefl\[broker\]"):
        EmbeddedBroker().start()


def test_a_subscription_made_while_amqtt_walks_its_map_does_not_break_the_walk() -> None:
    # amqtt awaits inside these loops: another client's subscribe lands in the middle
    subs = SnapshotDict(a=[1])
    seen = []
    for topic in subs:
        subs[f"{topic}/new"] = []
        seen.append(topic)
    for topic, _ in subs.items():
        subs[f"{topic}/again"] = []
        seen.append(topic)
    assert seen == ["a", "a", "a/new"] and len(subs) == 4


@pytest.mark.network
def test_embedded_broker_on_a_given_port_serves_and_stops(embedded_broker: EmbeddedBroker) -> None:
    port = free_port()
    with EmbeddedBroker(port=port) as broker:
        assert broker.port == port and broker.running
        assert isinstance(broker._broker._subscriptions, SnapshotDict)  # amqtt's, made safe
        t = MqttTransport(client_id="probe", port=port)
        got = Inbox()
        t.subscribe("a/b", got)
        t.connect()
        t.publish("a/b", b"x")
        assert got.wait(1)
        t.close()
    assert not broker.running
    broker.stop()  # idempotent


@pytest.mark.network
def test_embedded_broker_reports_a_port_in_use(embedded_broker: EmbeddedBroker) -> None:
    with pytest.raises(EdgeFLError, match=f"could not listen on 127.0.0.1:{embedded_broker.port}"):
        EmbeddedBroker(port=embedded_broker.port, start_timeout=5).start()


@pytest.mark.network
def test_mosquitto_restarts_on_the_same_port(mosquitto: MosquittoBroker) -> None:
    port = mosquitto.port
    mosquitto.stop()
    assert not mosquitto.running
    mosquitto.start()
    assert mosquitto.running and mosquitto.port == port
    assert f"listener {port} 127.0.0.1" in mosquitto.config_text()
