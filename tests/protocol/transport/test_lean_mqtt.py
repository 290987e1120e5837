"""The lean MQTT client's own behaviour: packet bytes, refusals, keepalive, resend, bursts.

What it shares with paho's transport (sessions, will, restart, TLS, chunks) is tested on both
in ``test_mqtt.py`` and ``test_tls.py``; here is what only a client of our own can get wrong.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from helpers import Inbox, unique_id, wait_for

from coordinator.broker.embedded import MosquittoBroker
from protocol.errors import ConnectError, TransportError
from protocol.transport.lean_mqtt import LeanMqttTransport
from protocol.transport.mqtt_packets import (
    CONNECT,
    PINGREQ,
    PUBLISH,
    connect_packet,
    parse_packet,
    publish_packet,
    varint,
)
from protocol.transport.paho import MqttTransport


@pytest.mark.parametrize("n", [0, 127, 128, 16_383, 16_384, 2_097_151, 2_097_152])
def test_remaining_length_round_trips_at_every_width(n: int) -> None:
    head = b"\x30" + varint(n)
    assert len(varint(n)) == 1 + (n > 127) + (n > 16_383) + (n > 2_097_151)
    whole = head + bytes(n)
    assert parse_packet(whole) == (3, 0, len(head), len(whole))
    assert parse_packet(whole[:-1] if n else head[:-1]) is None  # incomplete: wait for more
    assert len(varint(268_435_455)) == 4


def test_packet_parsing_rejects_a_five_byte_length_and_waits_for_partial_ones() -> None:
    with pytest.raises(ValueError, match="over four bytes"):
        parse_packet(b"\x30\xff\xff\xff\xff\x01")
    with pytest.raises(ValueError, match=r"0\.\.268435455"):
        varint(268_435_456)
    packet = publish_packet("a/b", b"xyz", 1, 7, retain=True)
    assert packet[0] == 0x33  # PUBLISH, QoS 1, retain
    for cut in range(len(packet)):
        assert parse_packet(packet[:cut]) is None
    kind, flags, start, end = parse_packet(packet + b"more")  # type: ignore[misc]
    assert (kind, flags, end) == (PUBLISH, 0x3, len(packet))
    assert packet[start:end] == b"\x00\x03a/b\x00\x07xyz"


class FakeBroker:
    """A TCP server that answers CONNECT with a chosen CONNACK code, records what clients
    send and never acknowledges a PUBLISH; ``drop()`` closes the current connection."""

    def __init__(self, code: int = 0) -> None:
        self.code = code
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.packets: list[tuple[int, int, bytes]] = []  # (type, flags, body), all connections
        self.connections = 0
        self.silent = False  # stop answering PINGREQ
        self._conn: socket.socket | None = None
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self._conn, self.connections = conn, self.connections + 1
            buf = bytearray()
            try:
                while chunk := conn.recv(65536):
                    buf += chunk
                    while (found := parse_packet(buf)) is not None:
                        kind, flags, start, end = found
                        self.packets.append((kind, flags, bytes(buf[start:end])))
                        del buf[:end]
                        if kind == CONNECT:
                            conn.sendall(bytes([0x20, 2, 0, self.code]))
                        elif kind == PINGREQ and not self.silent:
                            conn.sendall(b"\xd0\x00")
            except OSError:
                pass

    def drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):  # the client may have closed it already
                self._conn.shutdown(socket.SHUT_RDWR)
            self._conn.close()

    def close(self) -> None:
        self.server.close()
        self.drop()


@pytest.fixture
def fake() -> Iterator[FakeBroker]:
    broker = FakeBroker()
    yield broker
    broker.close()


def _lean(port: int, **kw: object) -> LeanMqttTransport:
    options: dict[str, object] = {"reconnect_min": 0.05, "reconnect_max": 0.2}
    options.update(kw)
    return LeanMqttTransport(client_id=unique_id("lean"), port=port, **options)  # type: ignore[arg-type]


def test_a_refused_session_names_the_reason_and_is_not_retried() -> None:
    broker = FakeBroker(code=4)
    try:
        t = _lean(broker.port)
        with pytest.raises(ConnectError, match="refused the session: bad user name or password"):
            t.connect(retry_for=30.0)
        assert broker.connections == 1 and not t.connected
    finally:
        broker.close()


def test_connect_sends_credentials_will_and_session_flags(fake: FakeBroker) -> None:
    from protocol.transport.base import Will

    t = _lean(fake.port, username="coord", password="s3cret", will=Will("w/t", b"gone"))
    t.connect()
    t.close()
    body = next(b for k, _, b in fake.packets if k == CONNECT)
    expected = connect_packet(
        t.client_id,
        keepalive=30,
        clean_session=False,
        will=("w/t", b"gone", 1, True),
        username="coord",
        password="s3cret",
    )
    assert body == expected[2:]  # the fixed header's two bytes aside
    assert body[7] == 0x80 | 0x40 | 0x20 | 0x08 | 0x04  # user, password, will retain/qos1/flag


def test_unacknowledged_publishes_are_sent_again_marked_dup_after_a_reconnect(
    fake: FakeBroker,
) -> None:
    t = _lean(fake.port)
    t.connect()
    try:
        t.publish("q/one", b"1")
        t.publish("q/zero", b"0", qos=0)
        assert wait_for(lambda: sum(k == PUBLISH for k, _, _ in fake.packets) == 2)
        fake.drop()  # the broker never acknowledged "q/one"
        assert wait_for(lambda: fake.connections == 2 and t.connected, timeout=10)
        assert wait_for(lambda: sum(k == PUBLISH for k, _, _ in fake.packets) == 3)
        again = [(f, b) for k, f, b in fake.packets if k == PUBLISH][-1]
        assert again[0] & 0x08 and again[0] & 0x06 == 0x02  # DUP, QoS 1
        assert again[1].startswith(b"\x00\x05q/one") and again[1].endswith(b"1")
    finally:
        t.abort()


def test_a_broker_that_stops_answering_pings_is_left_and_reconnected(fake: FakeBroker) -> None:
    t = _lean(fake.port, keepalive=1)
    t.connect()
    try:
        assert wait_for(lambda: any(k == PINGREQ for k, _, _ in fake.packets), timeout=5)
        fake.silent = True
        assert wait_for(lambda: fake.connections >= 2, timeout=10)
    finally:
        t.abort()


@pytest.mark.network
def test_keepalive_holds_an_idle_connection(mosquitto: MosquittoBroker) -> None:
    # Mosquitto drops a client silent for 1.5 x keepalive; the client must speak first
    t = _lean(mosquitto.port, keepalive=1)
    lost: list[bool] = []
    t.add_connect_listener(lost.append)
    t.connect()
    try:
        time.sleep(3.5)
        assert t.connected and len(lost) == 1  # one connect, no reconnect
    finally:
        t.close()


@pytest.mark.network
def test_a_burst_arrives_whole_in_order_and_acknowledged(mosquitto: MosquittoBroker) -> None:
    # Prepare: the lean client subscribes; paho publishes a burst at QoS 1
    lean, paho = (
        _lean(mosquitto.port, clean_session=True),
        MqttTransport(client_id=unique_id("paho"), port=mosquitto.port, clean_session=True),
    )
    got = Inbox()
    lean.subscribe("burst/+", got)
    lean.connect()
    paho.connect()
    try:
        # Execute
        for i in range(3000):
            paho.publish(f"burst/{i % 7}", i.to_bytes(4, "big") * 2000)
        # Assert: every message once, in order (one publisher, QoS 1)
        assert got.wait(3000, timeout=120)
        assert [int.from_bytes(p[:4], "big") for _, p in got.items] == list(range(3000))
        # and the other way: a burst published by the lean client reaches paho, all acked
        back = Inbox()
        paho.subscribe("back/#", back)
        for i in range(3000):
            lean.publish(f"back/{i % 5}", i.to_bytes(4, "big"))
        assert back.wait(3000, timeout=120)
        assert wait_for(lambda: not lean._inflight, timeout=30)
    finally:
        lean.close()
        paho.close()


def test_publishing_while_closed_or_with_a_bad_topic_is_refused(fake: FakeBroker) -> None:
    t = _lean(fake.port)
    with pytest.raises(TransportError, match="not connected"):
        t.publish("a", b"x")
    t.connect()
    try:
        for topic in ("", "a/+", "a/#"):
            with pytest.raises(TransportError, match="invalid topic"):
                t.publish(topic, b"x")
    finally:
        t.close()


def test_a_batch_is_queued_in_order_under_its_own_packet_ids_or_not_at_all(
    fake: FakeBroker,
) -> None:
    t = _lean(fake.port)
    t.connect()
    try:
        # Execute: an empty batch, a batch of three, then one with a bad topic in it
        t.publish_many([])
        t.publish_many([("b/0", b"zero"), ("b/1", b"one"), ("b/2", b"two")])
        assert wait_for(lambda: sum(k == PUBLISH for k, _, _ in fake.packets) == 3)
        with pytest.raises(TransportError, match="invalid topic"):
            t.publish_many([("b/3", b"three"), ("b/+", b"bad")])
        t.publish("b/4", b"four")
        assert wait_for(lambda: sum(k == PUBLISH for k, _, _ in fake.packets) == 4)

        # Assert: QoS 1, distinct packet ids, in order; nothing of the refused batch
        sent = [(f, b) for k, f, b in fake.packets if k == PUBLISH]
        assert all(f & 0x06 == 0x02 for f, _ in sent)
        topics = [b[2 : 2 + int.from_bytes(b[:2], "big")].decode() for _, b in sent]
        assert topics == ["b/0", "b/1", "b/2", "b/4"]
        ids = [b[5:7] for _, b in sent]  # after the 2-byte length and the 3-byte topic
        assert len(set(ids)) == 4
        assert [b[7:] for _, b in sent] == [b"zero", b"one", b"two", b"four"]
    finally:
        t.abort()


def test_close_releases_its_sockets_and_the_transport_connects_again(fake: FakeBroker) -> None:
    from pathlib import Path

    def open_fds() -> int:
        return sum(1 for _ in Path("/proc/self/fd").iterdir())

    t = _lean(fake.port)
    t.connect()
    t.close()
    before = open_fds()
    for _ in range(20):
        other = _lean(fake.port)
        other.connect()
        other.close()
    assert open_fds() <= before  # no socket of 20 clients left behind
    t.connect()  # the same transport again, after close
    try:
        t.publish("again", b"1")
        assert wait_for(lambda: any(b.startswith(b"\x00\x05again") for _, _, b in fake.packets))
    finally:
        t.close()


@pytest.mark.network
def test_sockets_numbered_past_the_select_limit_still_carry_messages(
    mosquitto: MosquittoBroker,
) -> None:
    # Prepare: take this process's descriptors up to 1024, so the client's sockets (and its
    # wake-up pair) are numbered where select() cannot go: paho's loop fails there (a Ray
    # actor holding ~340 paho agents), the lean client's epoll must not
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 1200
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the hard open-file limit ({hard}) is below {need}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    fillers: list[int] = []
    client = _lean(mosquitto.port, clean_session=True)
    try:
        while not fillers or fillers[-1] < 1024:
            fillers.append(os.open(os.devnull, os.O_RDONLY))
        got = Inbox()
        client.subscribe("far/+", got)

        # Execute
        client.connect()
        client.publish("far/1", b"past FD_SETSIZE")

        # Assert
        assert client._sock is not None and client._sock.fileno() > 1024
        assert got.wait(1, timeout=10)
        assert got.items == [("far/1", b"past FD_SETSIZE")]
    finally:
        client.close()
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_idle_client_sleeps_until_its_keepalive_is_due(fake: FakeBroker) -> None:
    # an idle client wakes only for its keepalive, not every second (a publish wakes it)
    t = _lean(fake.port, keepalive=30)
    now = time.monotonic()
    assert 14.9 < t._until_keepalive(last_out=now, ping_sent=None) <= 15.01  # PINGREQ at 15 s
    assert 29.9 < t._until_keepalive(last_out=now - 20, ping_sent=now) <= 30.01  # its answer
    assert t._until_keepalive(last_out=now - 16, ping_sent=None) == 0.01  # overdue: at once
