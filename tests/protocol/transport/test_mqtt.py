"""Both MQTT transports (paho's and the lean socket client) and Endpoint against real brokers:
delivery, chunks, sessions, will, restart. Every test runs on each transport."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from helpers import Inbox, free_port, unique_id, wait_for

from coordinator.broker.embedded import EmbeddedBroker, MosquittoBroker
from protocol.contract.codec import Envelope, decode, encode
from protocol.contract.messages import Ack, Reply, Status
from protocol.contract.payloads import TensorMap
from protocol.contract.topics import Topics
from protocol.errors import ConnectError, TransportError
from protocol.transport.base import Will
from protocol.transport.endpoint import Endpoint
from protocol.transport.lean_mqtt import LeanMqttTransport
from protocol.transport.paho import MqttTransport

T = Topics("fed")
KINDS = pytest.mark.parametrize("kind", [MqttTransport, LeanMqttTransport], ids=["paho", "lean"])
AnyMqtt = MqttTransport | LeanMqttTransport


class Made(list[AnyMqtt]):
    """The transports a test made, and which implementation it makes."""

    def __init__(self, kind: type[AnyMqtt]) -> None:
        super().__init__()
        self.kind = kind


@pytest.fixture(params=[MqttTransport, LeanMqttTransport], ids=["paho", "lean"])
def clients(request: pytest.FixtureRequest) -> Iterator[Made]:
    """Collects transports made by a test and closes them afterwards."""
    made = Made(request.param)
    yield made
    for t in made:
        t.close()


def _client(made: Made, port: int, client_id: str | None = None, **kw: object) -> AnyMqtt:
    t = made.kind(
        client_id=client_id or unique_id("c"),
        port=port,
        reconnect_min=0.05,
        reconnect_max=0.5,
        connect_timeout=5.0,
        **kw,
    )  # type: ignore[arg-type]
    made.append(t)
    return t


def _reply(n_floats: int, seed: int = 0) -> Reply:
    w = np.random.default_rng(seed).standard_normal(n_floats).astype(np.float32)
    return Reply(
        task_id="t1", round=1, phase="train", num_samples=5, payloads={"w": TensorMap({"w": w})}
    )


def _exchange(port: int, made: Made, n_floats: int = 1000) -> None:
    """Agent sends a reply, coordinator answers with an ack; both counted to the byte."""
    agent_t, coord_t = _client(made, port, "dev1"), _client(made, port, "coord")
    agent_t.connect()
    coord_t.connect()
    agent = Endpoint(agent_t, sender="dev1", federation="fed")
    coord = Endpoint(coord_t, sender="coord", federation="fed")
    at_coord, at_agent = Inbox(), Inbox()
    coord.subscribe(f"{T.base}/dev/+/up/#", at_coord)
    agent.subscribe(f"{T.base}/dev/dev1/down/#", at_agent)
    sent = agent.send(T.up("dev1", "reply"), _reply(n_floats), round=1)
    assert at_coord.wait(1, timeout=60)
    env, topic = at_coord.items[0]
    assert isinstance(env, Envelope) and env.msg_id == sent.msg_id
    assert topic == T.up("dev1", "reply")
    assert np.array_equal(
        env.body.payloads["w"].tensors["w"],  # type: ignore[union-attr]
        sent.body.payloads["w"].tensors["w"],
    )  # type: ignore[union-attr]
    coord.send(T.down("dev1", "ack"), Ack(ref_id=sent.msg_id))
    assert at_agent.wait(1)
    assert at_agent.items[0][0].body == Ack(ref_id=sent.msg_id)  # type: ignore[attr-defined]
    assert coord.traffic.bytes[("rx", "reply")] == agent.traffic.bytes[("tx", "reply")]
    assert agent.traffic.bytes[("rx", "ack")] == coord.traffic.bytes[("tx", "ack")]
    assert coord.rejected == {} and agent.rejected == {}


@KINDS
def test_unreachable_broker_fails_fast_with_the_address(kind: type[AnyMqtt]) -> None:
    port = free_port()
    t = kind(client_id="x", port=port, connect_timeout=5.0)
    with pytest.raises(ConnectError, match=f"cannot reach MQTT broker at 127.0.0.1:{port}"):
        t.connect()
    assert not t.connected


@KINDS
def test_a_server_that_never_answers_is_a_connect_error(kind: type[AnyMqtt]) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        t = kind(client_id="x", port=server.getsockname()[1], connect_timeout=0.3)
        with pytest.raises(ConnectError, match=r"no CONNACK within 0\.3 s"):
            t.connect()


@pytest.mark.network
def test_qos1_exchange_through_mosquitto(mosquitto: MosquittoBroker, clients: Made) -> None:
    _exchange(mosquitto.port, clients)


@pytest.mark.network
def test_20_mb_payload_travels_in_chunks(mosquitto: MosquittoBroker, clients: Made) -> None:
    agent_t, coord_t = _client(clients, mosquitto.port, "dev1"), _client(clients, mosquitto.port)
    agent_t.connect()
    coord_t.connect()
    agent = Endpoint(agent_t, sender="dev1", federation="fed")
    coord = Endpoint(coord_t, sender="coord", federation="fed")
    got = Inbox()
    coord.subscribe(f"{T.base}/dev/+/up/#", got)
    sent = agent.send(T.up("dev1", "reply"), _reply(5_000_000))  # 20 MB of float32
    assert got.wait(1, timeout=120)
    w = got.items[0][0].body.payloads["w"].tensors["w"]  # type: ignore[attr-defined]
    assert np.array_equal(w, sent.body.payloads["w"].tensors["w"])  # type: ignore[union-attr]
    assert agent.traffic.chunks[("tx", "reply")] == coord.traffic.chunks[("rx", "reply")] > 70
    assert coord.traffic.bytes[("rx", "reply")] == agent.traffic.bytes[("tx", "reply")]


@pytest.mark.network
def test_persistent_session_keeps_messages_while_the_client_is_away(
    mosquitto: MosquittoBroker, clients: Made
) -> None:
    # Prepare: the agent's session exists with a subscription, then the agent goes away
    sub_id, topic = unique_id("dev"), T.down("dev9", "task")
    first = _client(clients, mosquitto.port, sub_id)
    first.subscribe(topic, lambda t, p: None)
    first.connect()
    first.close()
    sender = _client(clients, mosquitto.port)
    sender.connect()
    # Execute: messages published while it is away; then it comes back with the same id
    for i in range(5):
        sender.publish(topic, f"m{i}".encode())
    got = Inbox()
    back = _client(clients, mosquitto.port, sub_id)
    back.subscribe(topic, got)  # handlers registered before connect see the queued messages
    back.connect()
    # Assert
    assert got.wait(5)
    assert back.session_present
    assert [p for _, p in got.items] == [f"m{i}".encode() for i in range(5)]


@pytest.mark.network
def test_reconnect_and_delivery_after_broker_restart(
    mosquitto: MosquittoBroker, clients: Made
) -> None:
    a, b = _client(clients, mosquitto.port), _client(clients, mosquitto.port)
    at_a, at_b = Inbox(), Inbox()
    a.subscribe("loop/a", at_a)
    b.subscribe("loop/b", at_b)
    a.connect()
    b.connect()
    # the broker goes away; QoS 1 waits in the client, QoS 0 cannot
    mosquitto.stop()
    assert wait_for(lambda: not a.connected and not b.connected)
    a.publish("loop/a", b"queued while down", qos=1)
    with pytest.raises(TransportError, match="not queued"):
        a.publish("loop/a", b"lost", qos=0)
    mosquitto.start()
    assert wait_for(lambda: a.connected and b.connected, timeout=30)
    # a re-subscribes before it resends, so its own queued message comes back to it
    assert at_a.wait(1)
    assert at_a.items[0][1] == b"queued while down"
    # `connected` says b's SUBSCRIBE went out, not that the broker has taken it, and a's
    # publish travels on another connection: it could overtake it (failed once in a full suite
    # on a loaded 2-core VM). b's own message comes back once its subscription is in place
    b.publish("loop/b", b"b is subscribed")
    assert at_b.wait(1)
    a.publish("loop/b", b"after restart")
    assert at_b.wait(2)
    assert [payload for _, payload in at_b.items] == [b"b is subscribed", b"after restart"]


@pytest.mark.network
def test_last_will_on_abrupt_disconnect(mosquitto: MosquittoBroker, clients: Made) -> None:
    will_env = Envelope(body=Status(state="offline"), sender="dev1", federation="fed")
    agent = _client(clients, mosquitto.port, will=Will(T.status("dev1"), encode(will_env)))
    agent.connect()
    watcher = _client(clients, mosquitto.port)
    seen = Inbox()
    watcher.subscribe(f"{T.base}/dev/+/status", seen)
    watcher.connect()
    agent.abort()
    assert seen.wait(1)
    topic, payload = seen.items[0]
    assert topic == T.status("dev1") and decode(payload).body == Status(state="offline")  # type: ignore[arg-type]


@pytest.mark.network
def test_mqtt5_max_packet_size_lowers_the_chunk_size(clients: Made) -> None:
    if clients.kind is not MqttTransport:
        pytest.skip("MQTT 5 is paho's only (the lean client speaks 3.1.1)")
    with MosquittoBroker(max_packet_size=65_536) as broker:
        agent_t = _client(clients, broker.port, "dev1", protocol="5")
        coord_t = _client(clients, broker.port, protocol="5")
        agent_t.connect()
        coord_t.connect()
        assert agent_t.max_packet_size == 65_536
        with pytest.raises(TransportError, match="maximum packet size"):
            agent_t.publish("big", bytes(70_000))
        agent = Endpoint(agent_t, sender="dev1", federation="fed")
        coord = Endpoint(coord_t, sender="coord", federation="fed")
        got = Inbox()
        coord.subscribe(f"{T.base}/dev/+/up/#", got)
        agent.send(T.up("dev1", "reply"), _reply(100_000))
        assert got.wait(1, timeout=30)
        assert agent.traffic.chunks[("tx", "reply")] >= 400_000 // 65_536


@pytest.mark.network
def test_a_failing_handler_does_not_stop_delivery(
    mosquitto: MosquittoBroker, clients: Made
) -> None:
    t = _client(clients, mosquitto.port)
    good = Inbox()
    calls = threading.Event()

    def bad(topic: str, payload: bytes) -> None:
        calls.set()
        raise RuntimeError("handler bug")

    t.subscribe("h/bad", bad)
    t.subscribe("h/good", good)
    t.connect()
    t.publish("h/bad", b"1")
    t.publish("h/good", b"2")
    assert good.wait(1) and calls.is_set()


@pytest.mark.network
def test_exchange_through_the_embedded_broker(
    embedded_broker: EmbeddedBroker, clients: Made
) -> None:
    _exchange(embedded_broker.port, clients, n_floats=200_000)  # 800 KB: chunked too


@pytest.mark.network
def test_connect_waits_for_a_broker_that_starts_later(clients: Made) -> None:
    # a device that boots before its broker waits for it instead of exiting at once
    # Prepare: nothing listens on the port yet
    broker = MosquittoBroker(port=free_port())
    client = _client(clients, broker.port)
    done = threading.Event()
    errors: list[Exception] = []

    def connect() -> None:
        try:
            client.connect(retry_for=60.0)
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)
        done.set()

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    # Execute: the broker comes up only after the client's first attempts failed
    try:
        assert wait_for(lambda: client._attempt >= 2, timeout=30)
        broker.start()
        assert done.wait(60)
        # Assert
        assert not errors, errors
        assert client.connected
    finally:
        client.close()
        broker.cleanup()


@KINDS
def test_connect_retry_is_bounded(kind: type[AnyMqtt]) -> None:
    port = free_port()
    t = kind(client_id="x", port=port, reconnect_min=0.05, reconnect_max=0.1)
    with pytest.raises(ConnectError, match=f"127.0.0.1:{port}"):
        t.connect(retry_for=0.5)
    assert t._attempt >= 2 and not t.connected
