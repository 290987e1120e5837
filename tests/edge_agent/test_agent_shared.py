"""The agent's side of the broadcast: a task naming knowledge runs on the merged
payload map; knowledge it lacks is fetched, retried, and the task fails before its deadline
when it never comes; forged or mislabelled knowledge is refused."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from coordinator.sim.simulate import agent_options
from edge_agent.algorithms.base import PhaseResult
from edge_agent.factory import build_agent
from edge_agent.knowledge_cache import FetchPolicy, KnowledgeCache, merge
from protocol.algorithms import config_type
from protocol.contract.codec import Envelope, decode, encode
from protocol.contract.messages import (
    UNKNOWN_KNOWLEDGE,
    ErrorReply,
    Fetch,
    Knowledge,
    Reply,
    Task,
)
from protocol.contract.payloads import PrototypeSet
from protocol.contract.topics import COORDINATOR_ID, Topics
from protocol.errors import ValidationError
from protocol.transport.base import MemoryBroker, MemoryTransport
from tests.helpers_runtime import FLEET, run_config

TOPICS = Topics()
QUICK = FetchPolicy(attempts=3, first_wait_s=0.2, margin_s=1.0)  # gives up within a second


def patient(first_wait_s: float) -> FetchPolicy:
    """A policy whose attempts outlast any test: only the deadline or an answer ends it."""
    return FetchPolicy(attempts=100, first_wait_s=first_wait_s, margin_s=1.0)


def protos(value: float = 1.0) -> PrototypeSet:
    return PrototypeSet(
        np.arange(3, dtype=np.int32), np.full((3, 16), value, np.float32), np.ones(3, np.int32)
    )


def task(knowledge: Knowledge | None, payloads: dict[str, Any] | None = None, **kw: Any) -> Task:
    return Task(
        task_id=kw.pop("task_id", "run.1.0.agent0"),
        run_id="run",
        round=1,
        phase="train",
        deadline=kw.pop("deadline", time.time() + 600),
        algorithm="fedproto",
        config=config_type("fedproto")(local_epochs=1).to_dict(),
        payloads=payloads or {},
        shared=b"" if knowledge is None else knowledge.digest,
    )


class Coordinator:
    """Raw frames on the coordinator's side: what the agent sends up, and sending down."""

    def __init__(self, broker: MemoryBroker) -> None:
        self.transport = MemoryTransport(broker, COORDINATOR_ID)
        self.transport.connect()
        self.inbox: queue.Queue[Envelope] = queue.Queue()
        self.transport.subscribe(
            f"{TOPICS.base}/dev/+/up/#", lambda t, d: self.inbox.put(decode(d))
        )

    def send(
        self, topic: str, body: Any, sender: str = COORDINATOR_ID, retain: bool = False
    ) -> None:
        self.transport.publish(topic, encode(Envelope(body=body, sender=sender)), retain=retain)

    def next(self, kind: type, timeout: float = 30) -> Envelope:
        end = time.monotonic() + timeout
        while True:
            env = self.inbox.get(timeout=max(0.01, end - time.monotonic()))
            if isinstance(env.body, kind):
                return env

    def kinds(self) -> list[str]:
        out = []
        while not self.inbox.empty():
            out.append(self.inbox.get().kind)
        return out


class Agent:
    """The FLEET's agent 0 with its algorithm replaced by a recorder (no training)."""

    def __init__(self, tmp_path: Path, broker: MemoryBroker, policy: FetchPolicy) -> None:
        opts = agent_options(run_config(tmp_path), FLEET, 0)
        self.transport = MemoryTransport(broker, opts.device_id)
        self.agent = build_agent(opts, self.transport)
        self.agent.fetch_policy = policy
        self.seen: list[dict[str, Any]] = []

        def handle(t: Task) -> PhaseResult:
            self.seen.append(dict(t.payloads))
            return PhaseResult(num_samples=1)

        self.agent.algorithm.handle = handle  # type: ignore[method-assign]
        self.agent.ctx.global_test = None
        self.agent._evaluate = lambda task: {}  # type: ignore[method-assign]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.agent.run, args=(self.stop,), daemon=True)
        self.transport.connect()
        self.agent.start()
        self.thread.start()

    @property
    def id(self) -> str:
        return self.agent.settings.device_id

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def broadcast_then_task(coord: Coordinator, agent: Agent, own: dict[str, Any]) -> Knowledge:
    """The engine's order: round 1's knowledge retained on the broadcast topic, then a task for
    ``agent`` naming it, with ``own`` payloads of its own."""
    knowledge = Knowledge.of(1, {"protos": protos()})
    coord.send(TOPICS.bcast("knowledge"), knowledge, retain=True)
    coord.send(TOPICS.down(agent.id, "task"), task(knowledge, own))
    return knowledge


@pytest.fixture
def run(tmp_path: Path):
    broker = MemoryBroker()
    coord = Coordinator(broker)
    agents: list[Agent] = []

    def start(policy: FetchPolicy = QUICK) -> Agent:
        agents.append(Agent(tmp_path / f"a{len(agents)}", broker, policy))
        return agents[-1]

    yield broker, coord, start
    for a in agents:
        a.close()


def test_merge_restores_the_strategys_map_and_refuses_a_name_on_both_sides() -> None:
    shared, own = protos(1.0), protos(2.0)
    knowledge = Knowledge.of(1, {"protos": shared})
    merged = merge(task(knowledge, {"own": own}), knowledge)
    assert merged.payloads == {"protos": shared, "own": own} and merged.shared == b""
    with pytest.raises(ValidationError, match=r"task.payloads.*\['protos'\]"):
        merge(task(knowledge, {"protos": own}), knowledge)
    with pytest.raises(ValidationError, match=r"task\.shared"):
        merge(task(Knowledge.of(1, {"x": own})), knowledge)


def test_the_cache_keeps_the_last_few_by_digest() -> None:
    cache = KnowledgeCache(size=2)
    ks = [Knowledge.of(r, {"p": protos(float(r))}) for r in range(3)]
    for k in ks:
        cache.put(k)
    assert len(cache) == 2 and cache.get(ks[0].digest) is None
    assert cache.get(ks[2].digest) is ks[2]


def test_a_task_runs_on_the_broadcast_knowledge_merged_with_its_own(run) -> None:
    # Prepare
    _, coord, start = run
    agent = start()
    # Execute
    knowledge = broadcast_then_task(coord, agent, {"own": protos(3.0)})
    coord.next(Reply)
    # Assert: the algorithm saw both, and nothing was fetched
    assert sorted(agent.seen[0]) == ["own", "protos"]
    np.testing.assert_array_equal(
        agent.seen[0]["protos"].vectors, knowledge.payloads["protos"].vectors
    )
    assert "fetch" not in coord.kinds()


def test_a_late_agent_gets_the_retained_knowledge_without_fetching(run) -> None:
    _, coord, start = run
    knowledge = Knowledge.of(1, {"protos": protos()})
    coord.send(TOPICS.bcast("knowledge"), knowledge, retain=True)  # before the agent exists
    agent = start()
    coord.send(TOPICS.down(agent.id, "task"), task(knowledge))
    coord.next(Reply)
    assert list(agent.seen[0]) == ["protos"] and "fetch" not in coord.kinds()


def test_missing_knowledge_is_fetched_and_the_task_runs_when_it_comes(run) -> None:
    # Prepare
    _, coord, start = run
    agent = start()
    knowledge = Knowledge.of(1, {"protos": protos()})
    # Execute: the task first, no broadcast
    coord.send(TOPICS.down(agent.id, "task"), task(knowledge))
    fetch = coord.next(Fetch)
    assert fetch.body.digest == knowledge.digest and fetch.sender == agent.id
    coord.send(TOPICS.down(agent.id, "knowledge"), knowledge)
    # Assert
    coord.next(Reply)
    assert list(agent.seen[0]) == ["protos"]


def test_a_fetch_is_retried_then_the_task_fails_naming_the_digest(run) -> None:
    # Prepare
    _, coord, start = run
    agent = start()
    knowledge = Knowledge.of(1, {"protos": protos()})
    # Execute
    coord.send(TOPICS.down(agent.id, "task"), task(knowledge))
    fetches = [coord.next(Fetch) for _ in range(3)]  # attempts=3, 0.2 s then 0.4 s apart
    error = coord.next(ErrorReply).body
    # Assert
    assert len({f.msg_id for f in fetches}) == 3
    assert error.code == "KnowledgeError" and error.task_id == "run.1.0.agent0"
    assert knowledge.digest.hex() in error.reason and "3 fetches" in error.reason
    assert agent.seen == []


def test_the_task_fails_before_its_deadline_however_many_tries_are_left(run) -> None:
    _, coord, start = run
    agent = start(patient(0.1))
    knowledge = Knowledge.of(1, {"protos": protos()})
    deadline = time.time() + 1.5
    coord.send(TOPICS.down(agent.id, "task"), task(knowledge, deadline=deadline))
    error = coord.next(ErrorReply).body
    assert error.code == "KnowledgeError" and time.time() < deadline


def test_the_coordinators_unknown_knowledge_fails_the_task_at_once(run) -> None:
    _, coord, start = run
    agent = start(patient(10.0))
    knowledge = Knowledge.of(1, {"protos": protos()})
    coord.send(TOPICS.down(agent.id, "task"), task(knowledge))
    coord.next(Fetch)
    body = ErrorReply(code=UNKNOWN_KNOWLEDGE, reason="step moved on", ref_id=knowledge.digest.hex())
    coord.send(TOPICS.down(agent.id, "error"), body)
    error = coord.next(ErrorReply, timeout=5).body
    assert error.code == "KnowledgeError" and "step moved on" in error.reason


def test_a_task_whose_own_payload_collides_with_the_knowledge_fails(run) -> None:
    _, coord, start = run
    agent = start()
    broadcast_then_task(coord, agent, {"protos": protos(2.0)})
    error = coord.next(ErrorReply).body
    assert error.code == "ValidationError" and "protos" in error.reason
    assert agent.seen == []


def test_knowledge_with_a_wrong_digest_or_from_a_device_is_never_used(run) -> None:
    # Prepare
    _, coord, start = run
    agent = start(patient(10.0))
    knowledge = Knowledge.of(1, {"protos": protos()})
    forged = protos(9.0)
    # a frame claiming the digest of `knowledge` for other payloads (built by hand: the
    # dataclass refuses it)
    body = {
        "round": 1,
        "digest": knowledge.digest,
        "payloads": {"protos": {"t": "protos", **forged.to_wire()}},
    }
    frame = {
        "v": 1,
        "k": "knowledge",
        "f": "default",
        "s": COORDINATOR_ID,
        "i": "f00d",
        "r": 1,
        "t": time.time(),
        "b": body,
    }
    coord.transport.publish(TOPICS.bcast("knowledge"), msgpack.packb(frame, use_bin_type=True))
    # the right knowledge, but sent by a device
    coord.send(TOPICS.down(agent.id, "knowledge"), knowledge, sender="agent1")
    coord.send(TOPICS.down(agent.id, "task"), task(knowledge))
    # Assert: neither was taken; the agent fetches
    coord.next(Fetch)
    assert agent.agent.endpoint.rejected["ValidationError"] == 1
    assert agent.agent.endpoint.rejected["foreign_knowledge"] == 1
    assert agent.seen == [] and len(agent.agent.knowledge) == 0
    coord.send(TOPICS.down(agent.id, "knowledge"), knowledge)
    coord.next(Reply)
    np.testing.assert_array_equal(agent.seen[0]["protos"].vectors, protos().vectors)
