"""Chunking through an Endpoint: lost, reordered and duplicated chunks, requests, limits."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
from helpers import wait_for

from protocol.contract.chunking import DEFAULT_CHUNK_POLICY, ChunkPolicy, request_topic, split_frame
from protocol.contract.codec import Envelope, Limits, encode
from protocol.contract.messages import Chunk, Reply, Task
from protocol.contract.payloads import TensorMap
from protocol.contract.topics import Topics
from protocol.errors import LimitError
from protocol.transport.base import MemoryBroker, MemoryTransport
from protocol.transport.endpoint import Endpoint

T = Topics("fed")
LIMITS = Limits()
UP = T.up("dev1", "reply")
UP_CHUNKS = T.chunk_topic(UP)  # where the chunk frames of a message on UP travel
POLICY = ChunkPolicy(
    threshold=4096, request_after=1.0, partial_timeout=10.0, max_requests=2, sweep_interval=None
)


class Clock:
    """A fake monotonic clock the test advances by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class HoldingTransport(MemoryTransport):
    """A memory transport that can hold what it publishes and release it in any order."""

    def __init__(self, broker: MemoryBroker, client_id: str) -> None:
        super().__init__(broker, client_id)
        self.hold = False
        self.held: list[tuple[str, bytes]] = []

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        if self.hold:
            self.held.append((topic, payload))
            return
        super().publish(topic, payload, qos=qos, retain=retain)

    def release(self, order: list[int]) -> None:
        for i in order:
            super().publish(*self.held[i])


class Pair:
    """An agent endpoint ``dev1`` and a coordinator endpoint on one memory broker."""

    def __init__(self, policy: ChunkPolicy = POLICY, limits: Limits = LIMITS) -> None:
        self.clock = Clock()
        broker = MemoryBroker()
        self.agent_t = HoldingTransport(broker, "dev1")
        self.coord_t = HoldingTransport(broker, "coord")
        self.agent_t.connect()
        self.coord_t.connect()
        self.agent = Endpoint(
            self.agent_t,
            sender="dev1",
            federation="fed",
            chunking=policy,
            limits=limits,
            clock=self.clock,
        )
        self.coord = Endpoint(
            self.coord_t,
            sender="coord",
            federation="fed",
            chunking=policy,
            limits=limits,
            clock=self.clock,
        )
        self.at_coord: list[Envelope] = []
        self.at_agent: list[Envelope] = []
        self.coord.subscribe(f"{T.base}/dev/+/up/#", lambda e, t: self.at_coord.append(e))
        self.agent.subscribe(f"{T.base}/dev/dev1/down/#", lambda e, t: self.at_agent.append(e))
        self.agent.subscribe(T.bcast("#"), lambda e, t: self.at_agent.append(e))


def _reply(n_floats: int = 12_000, seed: int = 0) -> Reply:
    w = np.random.default_rng(seed).standard_normal(n_floats).astype(np.float32)
    return Reply(
        task_id="t1", round=3, phase="train", num_samples=7, payloads={"w": TensorMap({"w": w})}
    )


def _weights(env: Envelope) -> np.ndarray:
    return env.body.payloads["w"].tensors["w"]  # type: ignore[union-attr]


def test_large_message_travels_as_chunks_within_the_threshold() -> None:
    # Prepare
    pair = Pair()
    pair.agent_t.hold = True
    # Execute
    sent = pair.agent.send(UP, _reply(), round=3)
    frames = list(pair.agent_t.held)
    pair.agent_t.release(list(range(len(frames))))
    # Assert
    assert len(frames) > 10 and all(len(f) <= POLICY.threshold for _, f in frames)
    assert [e.msg_id for e in pair.at_coord] == [sent.msg_id]
    assert np.array_equal(_weights(pair.at_coord[0]), _weights(sent))
    wire = sum(len(f) for _, f in frames)
    assert pair.agent.traffic.snapshot() == {"tx.reply": wire}
    assert pair.coord.traffic.snapshot() == {"rx.reply": wire}
    assert pair.coord.traffic.messages[("rx", "reply")] == 1
    assert pair.coord.traffic.chunks[("rx", "reply")] == len(frames)


def test_reordered_and_duplicated_chunks_deliver_once() -> None:
    pair = Pair()
    pair.agent_t.hold = True
    pair.agent.send(UP, _reply())
    n = len(pair.agent_t.held)
    order = [*range(n), 0, n // 2, n - 1]
    random.Random(1).shuffle(order)
    order += [2, 3]  # duplicates after completion too
    pair.agent_t.release(order)
    assert len(pair.at_coord) == 1
    assert pair.coord.rejected == {}
    # every received byte counts under the inner kind, late duplicates included
    assert pair.coord.traffic.snapshot() == {
        "rx.reply": sum(len(pair.agent_t.held[i][1]) for i in order)
    }


def test_lost_chunk_is_requested_and_resent() -> None:
    # Prepare: chunk 3 of the agent's reply is lost
    pair = Pair()
    pair.agent_t.hold = True
    pair.agent.send(UP, _reply())
    pair.agent_t.hold = False
    n = len(pair.agent_t.held)
    pair.agent_t.release([i for i in range(n) if i != 3])
    assert pair.at_coord == []
    # Execute: the coordinator notices the stall and asks dev1 on its down/chunk_req topic
    pair.clock.now += POLICY.request_after
    pair.coord.sweep_chunks()
    # Assert
    assert len(pair.at_coord) == 1
    assert pair.coord.traffic.messages[("tx", "chunk_req")] == 1
    assert pair.agent.traffic.messages[("rx", "chunk_req")] == 1
    assert pair.agent.traffic.chunks[("tx", "reply")] == n + 1
    assert pair.agent.traffic.total("tx") - pair.agent.traffic.bytes[("tx", "reply")] == 0


def test_lost_broadcast_chunk_is_requested_by_the_agent() -> None:
    pair = Pair()
    pair.coord_t.hold = True
    task = Task(
        task_id="t",
        run_id="r",
        round=1,
        phase="train",
        deadline=1.0,
        algorithm="fedavg",
        payloads={"w": _reply().payloads["w"]},
    )
    pair.coord.send(T.bcast("task"), task)
    pair.coord_t.hold = False
    pair.coord_t.release(list(range(1, len(pair.coord_t.held))))  # chunk 0 lost
    pair.clock.now += POLICY.request_after
    pair.agent.sweep_chunks()
    assert [e.kind for e in pair.at_agent] == ["task"]
    assert request_topic(T, T.bcast("task"), "dev1") == T.up("dev1", "chunk_req")


def test_partial_message_is_dropped_after_the_requests_run_out() -> None:
    pair = Pair()
    pair.agent_t.hold = True
    pair.agent.send(UP, _reply())
    frames = list(pair.agent_t.held)
    pair.agent_t.release(list(range(1, len(frames))))  # chunk 0 lost; resends stay held too
    for _ in range(POLICY.max_requests + 2):
        pair.clock.now += POLICY.request_after * (POLICY.max_requests + 2)
        pair.coord.sweep_chunks()
    assert pair.at_coord == []
    assert pair.coord.rejected["incomplete"] == 1
    # bytes of a message never completed stay under "chunk"
    received = {k: v for k, v in pair.coord.traffic.snapshot().items() if k.startswith("rx.")}
    assert received == {"rx.chunk": sum(len(f) for _, f in frames[1:])}
    assert pair.coord.traffic.messages[("tx", "chunk_req")] == POLICY.max_requests


def _chunk_frame(chunk: Chunk, sender: str = "dev1") -> bytes:
    return encode(Envelope(body=chunk, sender=sender, federation="fed"))


def test_declared_size_above_the_cap_is_refused_before_holding_anything() -> None:
    pair = Pair(limits=Limits(max_message=1 << 20))
    chunk = Chunk(digest=bytes(32), index=0, count=2, total_size=(1 << 20) + 1, data=b"x")
    pair.agent_t.publish(UP_CHUNKS, _chunk_frame(chunk))
    assert pair.coord.rejected == {"LimitError": 1}
    assert pair.coord._reassembler.pending == 0


def test_partial_messages_are_bounded_in_number_and_bytes() -> None:
    pair = Pair(
        policy=ChunkPolicy(
            threshold=4096, max_partials=2, max_partial_bytes=10_000, sweep_interval=None
        )
    )
    for i in range(3):
        pair.clock.now += 1
        chunk = Chunk(digest=bytes([i]) * 32, index=0, count=2, total_size=100, data=b"x")
        pair.agent_t.publish(UP_CHUNKS, _chunk_frame(chunk))
    big = Chunk(digest=bytes([9]) * 32, index=0, count=2, total_size=20_000, data=b"x")
    pair.agent_t.publish(UP_CHUNKS, _chunk_frame(big, sender="dev2"))
    # the third partial evicted the stalest; a message above the whole budget never fits
    assert pair.coord.rejected == {"evicted": 1, "LimitError": 1}
    assert pair.coord._reassembler.pending == 2
    assert pair.coord._reassembler.late_kind("dev1", bytes([0]) * 32) is None


def test_one_sender_cannot_spend_another_senders_budget() -> None:
    policy = ChunkPolicy(
        threshold=4096,
        max_sender_partials=2,
        max_sender_bytes=10_000,
        max_partial_bytes=20_000,
        sweep_interval=None,
    )
    pair = Pair(policy=policy)
    for i in range(4):  # announced sizes cost the announcer only: its stalest are evicted
        pair.clock.now += 1
        chunk = Chunk(digest=bytes([i]) * 32, index=0, count=9, total_size=9000, data=b"x")
        pair.agent_t.publish(
            T.chunk_topic(T.up("mallory", "reply")), _chunk_frame(chunk, sender="mallory")
        )
    assert pair.coord.rejected == {"evicted": 3}
    assert pair.coord._reassembler.pending == 1
    pair.agent.send(UP, _reply(2000))  # another sender's message is untouched and completes
    assert len(pair.at_coord) == 1
    assert pair.coord._reassembler.pending == 1


def test_bytes_actually_held_are_bounded_by_evicting_the_stalest() -> None:
    policy = ChunkPolicy(threshold=4096, max_partial_bytes=10_000, sweep_interval=None)
    pair = Pair(policy=policy)
    stale = Chunk(digest=bytes([1]) * 32, index=0, count=2, total_size=9000, data=b"x" * 6000)
    pair.agent_t.publish(T.chunk_topic(T.up("dev7", "reply")), _chunk_frame(stale, sender="dev7"))
    pair.clock.now += 1
    pair.agent.send(UP, _reply(2000))  # ~8 KB in chunks: evicts the stalled 6000 bytes
    assert len(pair.at_coord) == 1
    assert pair.coord.rejected == {"evicted": 1}
    assert pair.coord._reassembler.held_bytes == 0


def test_tampered_chunk_fails_the_digest_check() -> None:
    pair = Pair()
    frame = encode(Envelope(body=_reply(), sender="dev1", federation="fed"))
    chunks = split_frame(frame, 3000)
    bad = Chunk(
        digest=chunks[1].digest,
        index=1,
        count=chunks[1].count,
        total_size=chunks[1].total_size,
        data=bytes(len(chunks[1].data)),
    )
    for c in [chunks[0], bad, *chunks[2:]]:
        pair.agent_t.publish(UP_CHUNKS, _chunk_frame(c))
    assert pair.at_coord == []
    assert pair.coord.rejected == {"DecodeError": 1}


def test_chunk_contradicting_earlier_chunks_is_rejected() -> None:
    pair = Pair()
    digest = hashlib.sha256(b"whatever").digest()
    pair.agent_t.publish(
        UP_CHUNKS,
        _chunk_frame(Chunk(digest=digest, index=0, count=3, total_size=30, data=b"a" * 10)),
    )
    pair.agent_t.publish(
        UP_CHUNKS,
        _chunk_frame(Chunk(digest=digest, index=1, count=4, total_size=30, data=b"a" * 10)),
    )
    assert pair.coord.rejected == {"ValidationError": 1}
    assert pair.coord._reassembler.pending == 0


def test_chunked_message_must_come_from_the_chunk_sender() -> None:
    pair = Pair()
    frame = encode(Envelope(body=_reply(2000), sender="dev9", federation="fed"))
    for c in split_frame(frame, 3000):
        pair.agent_t.publish(UP_CHUNKS, _chunk_frame(c, sender="dev1"))
    assert pair.at_coord == [] and pair.coord.rejected == {"ProtocolError": 1}


def test_bulk_data_is_never_retained() -> None:
    pair = Pair()
    with pytest.raises(LimitError, match="retained"):
        pair.agent.send(UP, _reply(), retain=True)


def test_broker_max_packet_size_lowers_the_threshold() -> None:
    pair = Pair(policy=ChunkPolicy(sweep_interval=None))  # default 256 KiB threshold
    pair.agent_t.max_packet_size = 8192
    pair.agent_t.hold = True
    pair.agent.send(UP, _reply(50_000))
    assert all(len(f) + len(t) + 64 <= 8192 for t, f in pair.agent_t.held)
    pair.agent_t.release(list(range(len(pair.agent_t.held))))
    assert len(pair.at_coord) == 1


def test_request_for_an_evicted_frame_is_ignored() -> None:
    pair = Pair(
        policy=ChunkPolicy(
            threshold=4096, sent_cache_bytes=10, request_after=1.0, sweep_interval=None
        )
    )
    pair.agent_t.hold = True
    pair.agent.send(UP, _reply())
    pair.agent_t.hold = False
    pair.agent_t.release(list(range(1, len(pair.agent_t.held))))
    pair.clock.now += 1.0
    pair.coord.sweep_chunks()
    assert pair.at_coord == [] and pair.agent.traffic.messages[("rx", "chunk_req")] == 1


def test_background_sweeper_requests_missing_chunks() -> None:
    policy = ChunkPolicy(threshold=4096, request_after=0.05, sweep_interval=0.02)
    broker = MemoryBroker()
    agent_t, coord_t = HoldingTransport(broker, "dev1"), HoldingTransport(broker, "coord")
    agent_t.connect()
    coord_t.connect()
    agent = Endpoint(agent_t, sender="dev1", federation="fed", chunking=policy)
    coord = Endpoint(coord_t, sender="coord", federation="fed", chunking=policy)
    got: list[Envelope] = []
    coord.subscribe(f"{T.base}/dev/+/up/#", lambda e, t: got.append(e))
    agent_t.hold = True
    agent.send(UP, _reply())
    agent_t.hold = False
    agent_t.release(list(range(len(agent_t.held) - 1)))  # last chunk lost
    try:
        assert wait_for(lambda: len(got) == 1, timeout=20)
    finally:
        coord.close()


@pytest.mark.parametrize(
    ("topic", "expected"),
    [
        (T.up("d7", "reply"), T.down("d7", "chunk_req")),
        (T.down("d7", "task"), T.up("d7", "chunk_req")),
        (T.bcast("generator"), T.up("me", "chunk_req")),
        (T.round, None),
        ("other/prefix/dev/d7/up/reply", None),
    ],
)
def test_request_topics_follow_the_acl_layout(topic: str, expected: str | None) -> None:
    assert request_topic(T, topic, "me") == expected


def test_an_unsigned_frame_over_the_threshold_travels_as_chunks() -> None:
    # Prepare
    pair = Pair()
    env = pair.agent.envelope(_reply(), round=3)
    # Execute
    pair.agent.send_unsigned(UP, encode(env), kind="reply", round=3)
    # Assert: reassembled into the same envelope, counted as one chunked reply
    assert [e.msg_id for e in pair.at_coord] == [env.msg_id]
    assert np.array_equal(_weights(pair.at_coord[0]), _weights(env))
    assert pair.agent.traffic.chunks[("tx", "reply")] > 10
    assert pair.agent.traffic.bytes[("tx", "reply")] == pair.coord.traffic.bytes[("rx", "reply")]


def test_chunks_travel_on_the_chunk_topic_and_only_its_subscriber_reassembles() -> None:
    # Prepare: a leader that subscribes to the chunk topics only and routes the reassembled
    # replies locally (ingest workers' shared subscription is the message topic itself)
    broker = MemoryBroker()
    agent_t = HoldingTransport(broker, "dev1")
    agent_t.connect()
    agent = Endpoint(agent_t, sender="dev1", federation="fed", chunking=POLICY)
    agent_t.hold = True
    sent = agent.send(UP, _reply(), round=3)
    worker_t, leader_t = MemoryTransport(broker, "worker"), MemoryTransport(broker, "leader")
    worker_t.connect()
    leader_t.connect()
    worker = Endpoint(worker_t, sender="coord", federation="fed")
    leader = Endpoint(leader_t, sender="coord", federation="fed")
    at_worker: list[Envelope] = []
    got: list[tuple[Envelope, str]] = []
    worker.subscribe(f"{T.base}/dev/+/up/reply", lambda e, t: at_worker.append(e))
    leader.subscribe(f"{T.base}/dev/+/up/+/chunk", lambda e, t: got.append((e, t)))
    leader.deliver_locally(f"{T.base}/dev/+/up/reply", lambda e, t: got.append((e, t)))
    # Execute
    agent_t.release(list(range(len(agent_t.held))))
    # Assert: every frame went to the chunk topic; the worker saw none; the leader got the
    # message once, under the message's own topic, counted as a reply
    frames = agent_t.held
    assert len(frames) > 1 and {t for t, _ in frames} == {UP_CHUNKS}
    assert at_worker == [] and worker.traffic.snapshot() == {}
    assert [(e.msg_id, t) for e, t in got] == [(sent.msg_id, UP)]
    assert np.array_equal(_weights(got[0][0]), _weights(sent))
    assert leader.traffic.snapshot() == {"rx.reply": sum(len(f) for _, f in frames)}
    assert leader.rejected == {}


def test_a_chunk_off_its_chunk_topic_and_a_message_on_one_are_refused() -> None:
    # Prepare: a receiver of everything a device sends
    pair = Pair()
    chunk = Chunk(digest=bytes(32), index=0, count=2, total_size=2048, data=b"x" * 1024)
    whole = encode(Envelope(body=_reply(10), sender="dev1", federation="fed", round=3))
    # Execute: a chunk on the message topic, a whole reply on the chunk topic
    pair.agent_t.publish(UP, _chunk_frame(chunk))
    pair.agent_t.publish(UP_CHUNKS, whole)
    # Assert: both refused and counted as invalid bytes; nothing held or delivered
    assert pair.coord.rejected == {"ProtocolError": 2}
    assert pair.coord._reassembler.pending == 0 and pair.at_coord == []
    assert set(pair.coord.traffic.refused_snapshot()) == {"rx.invalid"}


def test_chunk_topics_are_a_device_messages_own_and_map_back() -> None:
    # up and down topics of a device get a chunk topic; broadcasts carry their own chunks
    for topic in (T.up("d7", "reply"), T.down("d7", "task"), T.down("chunk", "knowledge")):
        assert T.chunk_topic(topic) == f"{topic}/chunk"
        assert T.message_topic(T.chunk_topic(topic)) == topic
    for topic in (T.bcast("knowledge"), T.status("d7"), T.ingest("chunk"), T.coord_state):
        assert T.chunk_topic(topic) == topic
        assert T.message_topic(topic) is None
    # an up or down topic with "chunk" as its kind is a message topic, not a chunk topic
    assert T.message_topic(T.up("d7", "chunk")) is None
    assert T.message_topic(Topics("other").chunk_topic(Topics("other").up("d7", "reply"))) is None


def test_a_fleets_interleaved_chunked_replies_all_complete_under_the_default_policy() -> None:
    # 200 devices answer at once, chunk by chunk through the broker (chunk 0 of every reply,
    # then chunk 1...): every reply is partial at the same time. With at most 64 partials
    # held, 136 would be evicted and have to be requested again.
    senders = [f"dev{i:03d}" for i in range(200)]
    small = ChunkPolicy(threshold=4096, sweep_interval=None)  # the senders' side only
    frames: list[list[tuple[str, bytes]]] = []
    for i, device in enumerate(senders):
        transport = HoldingTransport(MemoryBroker(), device)
        transport.connect()
        transport.hold = True
        sender = Endpoint(transport, sender=device, federation="fed", chunking=small)
        sender.send(T.up(device, "reply"), _reply(2_000, seed=i), round=3)
        frames.append(transport.held)
        sender.close()
    assert {len(f) for f in frames} == {3}
    default = ChunkPolicy(sweep_interval=None)  # the default budgets, no background thread
    assert default.max_partials == DEFAULT_CHUNK_POLICY.max_partials
    broker = MemoryBroker()
    fleet, coord_t = MemoryTransport(broker, "fleet"), MemoryTransport(broker, "coord")
    fleet.connect()
    coord_t.connect()
    coord = Endpoint(coord_t, sender="coord", federation="fed", chunking=default)
    got: list[Envelope] = []
    coord.subscribe(f"{T.base}/dev/+/up/#", lambda e, t: got.append(e))
    for index in range(3):
        for held in frames:
            fleet.publish(*held[index])
    assert coord.rejected == {}
    assert sorted(e.sender for e in got) == senders
