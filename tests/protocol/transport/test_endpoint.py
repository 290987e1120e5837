"""Endpoint behaviour without chunks: dedupe, duplicate hook, dispatch, byte accounting."""

from __future__ import annotations

import dataclasses

import pytest

from protocol.contract.chunking import DEFAULT_CHUNK_POLICY
from protocol.contract.codec import Envelope, Limits, encode
from protocol.contract.messages import Ack, Reply
from protocol.contract.topics import Topics
from protocol.errors import LimitError
from protocol.security.signing import HmacSigner
from protocol.transport.base import MemoryBroker, MemoryTransport
from protocol.transport.endpoint import Endpoint

T = Topics("fed")


def _setup(**kw: object) -> tuple[MemoryTransport, Endpoint, list[tuple[str, Envelope, str]]]:
    broker = MemoryBroker()
    raw, t = MemoryTransport(broker, "raw"), MemoryTransport(broker, "coord")
    raw.connect()
    t.connect()
    endpoint = Endpoint(t, sender="coord", federation="fed", **kw)  # type: ignore[arg-type]
    seen: list[tuple[str, Envelope, str]] = []
    endpoint.subscribe(f"{T.base}/dev/+/up/#", lambda e, topic: seen.append(("all", e, topic)))
    endpoint.subscribe(T.up("dev1", "reply"), lambda e, topic: seen.append(("reply", e, topic)))
    return raw, endpoint, seen


def test_duplicates_are_dropped_and_reported_to_the_hook() -> None:
    dups: list[Envelope] = []
    raw, endpoint, seen = _setup(on_duplicate=lambda e, t: dups.append(e))
    frame = encode(
        Envelope(
            body=Reply(task_id="t", round=1, phase="p", num_samples=1),
            sender="dev1",
            federation="fed",
            msg_id="m-1",
        )
    )
    raw.publish(T.up("dev1", "reply"), frame)
    raw.publish(T.up("dev1", "reply"), frame)
    # both matching handlers see the first copy once; the second copy goes to the hook only
    assert [name for name, _, _ in seen] == ["all", "reply"]
    assert [e.msg_id for e in dups] == ["m-1"]
    assert endpoint.rejected == {"duplicate": 1}
    assert endpoint.traffic.bytes[("rx", "reply")] == 2 * len(frame)
    assert endpoint.traffic.messages[("rx", "reply")] == 2


def test_a_failing_handler_does_not_starve_the_others() -> None:
    raw, endpoint, seen = _setup()

    def boom(env: Envelope, topic: str) -> None:
        raise RuntimeError("bug")

    endpoint.subscribe(f"{T.base}/#", boom)
    raw.publish(T.up("dev1", "ack"), encode(Envelope(body=Ack(ref_id="r"), sender="dev1")))
    assert [name for name, _, _ in seen] == ["all"]


def test_rejected_bytes_are_counted_as_refused_invalid() -> None:
    raw, endpoint, seen = _setup()
    raw.publish(T.up("dev1", "reply"), b"\x81\xa1v\x02")
    assert seen == [] and endpoint.rejected == {"DecodeError": 1}
    assert endpoint.traffic.refused_snapshot() == {"rx.invalid": 4}
    assert endpoint.traffic.snapshot() == {}  # accepted traffic only


def test_a_message_a_handler_refuses_moves_to_the_refused_bytes() -> None:
    raw, endpoint, seen = _setup()
    frame = encode(Envelope(body=Ack(ref_id="r"), sender="dev1"))
    raw.publish(T.up("dev1", "ack"), frame)
    assert endpoint.traffic.snapshot() == {"rx.ack": len(frame)}
    endpoint.refuse(seen[0][1])
    assert endpoint.traffic.snapshot() == {}
    assert endpoint.traffic.refused_snapshot() == {"rx.ack": len(frame)}


def test_send_counts_what_it_publishes() -> None:
    broker = MemoryBroker()
    t = MemoryTransport(broker, "a")
    t.connect()
    frames: list[bytes] = []
    t.subscribe("#", lambda topic, data: frames.append(data))
    endpoint = Endpoint(t, sender="dev1", federation="fed")
    env = endpoint.send(T.up("dev1", "ack"), Ack(ref_id="r"), round=4, msg_id="fixed")
    assert (env.msg_id, env.round, env.sender) == ("fixed", 4, "dev1")
    assert endpoint.traffic.snapshot() == {"tx.ack": len(frames[0])}


def test_an_unsigned_frame_is_sealed_published_and_counted_as_its_envelope_would_be() -> None:
    broker = MemoryBroker()
    t = MemoryTransport(broker, "a")
    t.connect()
    frames: list[bytes] = []
    t.subscribe("#", lambda topic, data: frames.append(data))
    endpoint = Endpoint(t, sender="coord", federation="fed", signer=HmacSigner("coord", b"k" * 32))
    env = endpoint.envelope(Ack(ref_id="r", task_id="t"), round=2)
    endpoint.send_unsigned(T.down("dev1", "ack"), encode(env), kind="ack", round=2)
    assert frames == [endpoint.sealed(env)]  # signed, as send_envelope signs
    assert frames[0] != encode(env)
    assert endpoint.traffic.snapshot() == {"tx.ack": len(frames[0])}


def test_a_batch_is_sealed_sent_whole_or_chunked_and_counted_as_one_by_one_sends() -> None:
    # Prepare: a signing endpoint with a small chunk threshold; two small frames, one large
    broker = MemoryBroker()
    t = MemoryTransport(broker, "a")
    t.connect()
    frames: list[tuple[str, bytes]] = []
    t.subscribe("#", lambda topic, data: frames.append((topic, data)))
    policy = dataclasses.replace(DEFAULT_CHUNK_POLICY, threshold=2048)
    signer = HmacSigner("coord", b"k" * 32)
    endpoint = Endpoint(t, sender="coord", federation="fed", signer=signer, chunking=policy)
    small = [endpoint.envelope(Ack(ref_id=f"r{i}", task_id="t"), round=2) for i in range(2)]
    big = endpoint.envelope(Ack(ref_id="r" * 4000, task_id="t"), round=2)
    batch = [(T.down(f"dev{i}", "ack"), encode(env)) for i, env in enumerate([*small, big])]

    # Execute
    endpoint.send_many_unsigned(batch, kind="ack", round=2)

    # Assert: the small ones whole and signed, in order; the large one as chunk frames on
    # its chunk topic; bytes and messages counted as three sends would count them
    assert frames[:2] == [
        (T.down(f"dev{i}", "ack"), endpoint.sealed(env)) for i, env in enumerate(small)
    ]
    chunks = frames[2:]
    assert len(chunks) >= 2 and {topic for topic, _ in chunks} == {
        T.chunk_topic(T.down("dev2", "ack"))
    }
    assert endpoint.traffic.messages[("tx", "ack")] == 3
    whole = sum(len(f) for _, f in frames[:2]) + len(endpoint.sealed(big))
    assert endpoint.traffic.bytes[("tx", "ack")] >= whole
    one_by_one = Endpoint(t, sender="coord", federation="fed", signer=signer, chunking=policy)
    for topic, unsigned in batch:
        one_by_one.send_unsigned(topic, unsigned, kind="ack", round=2)
    assert one_by_one.traffic.snapshot() == endpoint.traffic.snapshot()
    assert one_by_one.traffic.messages == endpoint.traffic.messages
    assert one_by_one.traffic.chunks == endpoint.traffic.chunks

    # and a frame over the message cap refuses the batch before anything is sent
    capped = Endpoint(t, sender="coord", federation="fed", limits=Limits(max_message=1024))
    sent = len(frames)
    with pytest.raises(LimitError, match="exceeds the 1024-byte cap"):
        capped.send_many_unsigned([batch[0], batch[2]], kind="ack", round=2)
    assert len(frames) == sent
