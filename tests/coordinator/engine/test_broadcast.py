"""Broadcast: the engine moves the payloads a step's tasks share into one
``knowledge`` message, sent once on ``bcast/knowledge``, and answers ``fetch``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.engine.core import Coordinator
from coordinator.strategies import Step
from protocol.contract.codec import Envelope, decode
from protocol.contract.messages import (
    UNKNOWN_KNOWLEDGE,
    ErrorReply,
    Fetch,
    Knowledge,
    Task,
    payloads_digest,
)
from protocol.contract.payloads import PrototypeSet
from protocol.contract.topics import Topics
from protocol.transport.base import MemoryBroker, MemoryTransport
from tests.helpers_runtime import crash_and_resume, run_config, start_coordinator

STEP = Step(round=2, phase="train")


def protos(dim: int = 64, value: float = 1.0) -> PrototypeSet:
    """Ten classes of ``dim``-sized prototypes: 10 * dim * 4 bytes of vectors."""
    return PrototypeSet(
        np.arange(10, dtype=np.int32),
        np.full((10, dim), value, np.float32),
        np.ones(10, np.int32),
    )


def coordinator(tmp_path: Path, broker: MemoryBroker | None = None, **run: Any) -> Coordinator:
    return start_coordinator(run_config(tmp_path, **run), broker or MemoryBroker())


def task(device: str, payloads: dict[str, Any]) -> Task:
    return Task(
        task_id=f"t.{device}",
        run_id="t",
        round=STEP.round,
        phase=STEP.phase,
        deadline=1e9,
        algorithm="fedproto",
        payloads=payloads,
    )


def test_the_digest_hashes_the_sorted_tagged_payload_map() -> None:
    # Prepare
    import hashlib

    import msgpack

    a, b = protos(4, 1.0), protos(4, 2.0)
    wire = {
        "a": {"t": "protos", **a.to_wire()},
        "b": {"t": "protos", **b.to_wire()},
    }
    # Execute
    digest = payloads_digest({"b": b, "a": a})
    # Assert: insertion order does not matter; the bytes are the documented ones
    assert digest == hashlib.sha256(msgpack.packb(wire, use_bin_type=True)).digest()
    assert digest == payloads_digest({"a": a, "b": b}) != payloads_digest({"a": b, "b": a})


def test_a_knowledge_whose_digest_differs_is_refused_naming_the_field() -> None:
    from protocol.errors import ValidationError

    good = Knowledge.of(1, {"protos": protos(4)})
    with pytest.raises(ValidationError, match="digest"):
        Knowledge(round=1, digest=bytes(32), payloads=good.payloads)
    with pytest.raises(ValidationError, match="32 bytes"):
        Task(
            task_id="x", run_id="r", round=1, phase="train", deadline=1, algorithm="a", shared=b"1"
        )


def test_one_object_in_every_task_goes_into_the_knowledge(tmp_path: Path) -> None:
    # Prepare
    coord = coordinator(tmp_path)
    shared, mine = protos(), {d: protos(value=i) for i, d in enumerate("abc")}
    maps = {d: {"protos": shared, "own": mine[d]} for d in "abc"}
    # Execute
    out, digests, knowledge = coord.broadcast.split(STEP, maps)
    # Assert
    assert knowledge is not None and list(knowledge.payloads) == ["protos"]
    assert knowledge.payloads["protos"] is shared and knowledge.round == STEP.round
    assert knowledge.digest == payloads_digest({"protos": shared})
    for d in "abc":
        assert digests[d] == knowledge.digest
        assert out[d] == {"own": mine[d]}


def test_equal_but_distinct_objects_stay_inline(tmp_path: Path) -> None:
    coord = coordinator(tmp_path)
    maps = {d: {"protos": protos()} for d in "abc"}  # equal values, new objects
    out, digests, knowledge = coord.broadcast.split(STEP, maps)
    assert knowledge is None and out == maps and digests == {}


def test_a_payload_in_one_task_only_stays_inline(tmp_path: Path) -> None:
    coord = coordinator(tmp_path)
    maps = {"a": {"protos": protos()}, "b": {}}
    out, digests, knowledge = coord.broadcast.split(STEP, maps)
    assert knowledge is None and out == maps and digests == {}


def test_a_task_lacking_a_shared_name_keeps_its_payloads_inline(tmp_path: Path) -> None:
    # the agent merges the whole knowledge: a task without the name must not get it
    coord = coordinator(tmp_path)
    shared = protos()
    maps: dict[str, dict[str, Any]] = {d: {"protos": shared} for d in "ab"} | {"c": {}}
    out, digests, knowledge = coord.broadcast.split(STEP, maps)
    assert knowledge is not None
    assert digests == {"a": knowledge.digest, "b": knowledge.digest}
    assert out == {"a": {}, "b": {}, "c": {}}


def test_a_shared_payload_below_the_threshold_stays_inline(tmp_path: Path) -> None:
    # 10 x 4 float32 prototypes encode to ~250 bytes, 10 x 64 to ~2.7 KB
    coord = coordinator(tmp_path, broadcast_min_bytes=1024)
    small, big = protos(4), protos(64)
    maps = {d: {"small": small, "big": big} for d in "abc"}
    out, _, knowledge = coord.broadcast.split(STEP, maps)
    assert knowledge is not None and list(knowledge.payloads) == ["big"]
    assert all(own == {"small": small} for own in out.values())
    # 0: everything shared goes
    coord0 = coordinator(tmp_path / "zero", broadcast_min_bytes=0)
    _, _, k0 = coord0.broadcast.split(STEP, maps)
    assert k0 is not None and sorted(k0.payloads) == ["big", "small"]


def test_broadcast_off_keeps_every_payload_in_the_tasks(tmp_path: Path) -> None:
    coord = coordinator(tmp_path, broadcast=False)
    shared = protos()
    maps = {d: {"protos": shared} for d in "abc"}
    out, digests, knowledge = coord.broadcast.split(STEP, maps)
    assert knowledge is None and out == maps and digests == {}


def test_broadcast_min_bytes_must_not_be_negative(tmp_path: Path) -> None:
    from protocol.errors import ConfigError

    with pytest.raises(ConfigError, match="broadcast_min_bytes"):
        run_config(tmp_path, broadcast_min_bytes=-1)


def test_a_fetch_gets_the_open_steps_knowledge_or_an_error_naming_the_digest(
    tmp_path: Path,
) -> None:
    # Prepare: an open step whose task for device "a" names the knowledge
    from coordinator.engine.step import OpenStep
    from coordinator.store.database import StepRecord

    broker = MemoryBroker()
    coord = coordinator(tmp_path, broker)
    topics = Topics(coord.cfg.federation)
    knowledge = Knowledge.of(STEP.round, {"protos": protos()})
    open_step = OpenStep(StepRecord(0, STEP.round, STEP.phase, ["a"], "open", 0), STEP)
    open_step.sent("a", dataclasses.replace(task("a", {}), shared=knowledge.digest))
    coord._open_step, coord.broadcast.knowledge = open_step, knowledge
    got: list[tuple[str, Envelope]] = []
    spy = MemoryTransport(broker, "spy")
    spy.connect()
    spy.subscribe(f"{topics.base}/dev/+/down/#", lambda t, d: got.append((t, decode(d))))
    # Execute
    for device, digest in (("a", knowledge.digest), ("a", bytes(32)), ("b", knowledge.digest)):
        fetch = Fetch(digest=digest)  # b: no task of b
        coord._on_fetch(Envelope(body=fetch, sender=device), fetch)
    # Assert
    assert got[0][0] == topics.down("a", "knowledge")
    assert isinstance(got[0][1].body, Knowledge) and got[0][1].body.digest == knowledge.digest
    for (topic, env), device in zip(got[1:], "ab", strict=True):
        assert topic == topics.down(device, "error") and isinstance(env.body, ErrorReply)
        assert env.body.code == UNKNOWN_KNOWLEDGE and env.body.ref_id in env.body.reason
    assert got[1][1].body.ref_id == bytes(32).hex()
    assert coord.rejected["unknown_knowledge"] == 2


def test_knowledge_too_large_for_one_frame_is_chunked_and_not_retained(tmp_path: Path) -> None:
    # Prepare: a retained small knowledge, then one that needs chunks (bulk data is never
    # retained, WIRE.md §2): the retained one must go, not stay to name an older digest
    from protocol.contract.chunking import ChunkPolicy

    broker = MemoryBroker()
    coord = coordinator(tmp_path, broker)
    coord.endpoint.chunking = ChunkPolicy(threshold=4096)
    topic = Topics(coord.cfg.federation).bcast("knowledge")
    coord.broadcast.publish(Knowledge.of(1, {"protos": protos(4)}))
    assert decode(broker._retained[topic]).kind == "knowledge"
    got: list[Envelope] = []
    spy = MemoryTransport(broker, "spy")
    spy.connect()
    spy.subscribe(topic, lambda t, d: got.append(decode(d)) if d else None)
    got.clear()  # the retained one delivered on subscribing
    # Execute
    coord.broadcast.publish(Knowledge.of(2, {"protos": protos(256)}))  # ~10 KB
    # Assert
    assert topic not in broker._retained
    assert len(got) >= 3 and all(env.kind == "chunk" for env in got)
    assert coord.endpoint.traffic.chunks[("tx", "knowledge")] == len(got)


class CrashOnceError(RuntimeError):
    pass


def test_a_resumed_step_republishes_the_same_knowledge(tmp_path: Path, monkeypatch) -> None:
    # Prepare: the coordinator dies right after dispatching round 2 (its knowledge published);
    # a new one resumes the step from the store: configure is deterministic from durable
    # state, so the knowledge it rebuilds has the same digest and the agents' tasks still fit
    from tests.helpers_runtime import InProcessAgent

    cfg = run_config(tmp_path, rounds=2, broadcast_min_bytes=0)
    broker = MemoryBroker()
    topic = Topics(cfg.federation).bcast("knowledge")
    published: list[Knowledge] = []
    spy = MemoryTransport(broker, "spy")
    spy.connect()
    spy.subscribe(topic, lambda t, d: published.append(decode(d).body) if d else None)
    agents = [InProcessAgent(cfg, broker, i).start() for i in range(3)]
    original = Coordinator._wait_for_replies
    crashed: list[int] = []

    def wait(self: Coordinator, open_step: Any, end: float) -> None:
        if open_step.step.round == 2 and not crashed:
            crashed.append(1)
            raise CrashOnceError
        original(self, open_step, end)

    monkeypatch.setattr(Coordinator, "_wait_for_replies", wait)
    # Execute
    result = crash_and_resume(cfg, broker, CrashOnceError).run()
    # Assert
    round2 = [k.digest for k in published if k.round == 2]
    assert len(round2) == 2 and round2[0] == round2[1]
    assert [sorted(m["agents"]) for m in result.metrics] == [["agent0", "agent1", "agent2"]] * 3
    for a in agents:
        a.close()
