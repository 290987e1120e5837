"""Broadcast over a real Mosquitto: FedProto's global prototypes go once per step on
``bcast/knowledge`` and the tasks carry only their digest; an agent that connects late gets the
retained knowledge, one that reconnects mid-round gets it from its session, and one whose
broker has no retained copy fetches it. Every frame any party publishes is recorded."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from coordinator.config import RunConfig
from coordinator.engine.broadcast import KnowledgeBroadcast
from coordinator.engine.runner import coordinator_will, run_coordinator
from coordinator.sim.simulate import agent_options, agent_will, simulate
from edge_agent.agent import EdgeAgent
from edge_agent.factory import build_agent
from protocol.contract.codec import Envelope, decode
from protocol.contract.messages import Fetch, Knowledge, Task
from protocol.contract.topics import Topics
from protocol.transport.paho import MqttTransport
from tests.helpers_runtime import FLEET, run_config

pytestmark = [pytest.mark.network, pytest.mark.slow]

AGENTS = ["agent0", "agent1", "agent2"]
Frames = list[tuple[str, bytes, bool]]


class RecordingMqtt(MqttTransport):
    """An MQTT transport that keeps a copy of every frame it publishes."""

    def __init__(self, frames: Frames, lock: threading.Lock, **kw: Any) -> None:
        super().__init__(**kw)
        self._frames, self._frames_lock = frames, lock

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        if payload:
            with self._frames_lock:
                self._frames.append((topic, bytes(payload), retain))
        super().publish(topic, payload, qos=qos, retain=retain)


def config(tmp_path: Path, **run: Any) -> RunConfig:
    # FLEET's 16-dimension prototypes encode to ~900 bytes: broadcast them anyway
    return run_config(tmp_path, "fedproto", broadcast_min_bytes=0, **run)


def decoded(frames: Frames, lock: threading.Lock) -> list[tuple[str, Envelope, bool]]:
    with lock:
        return [(topic, decode(data), retain) for topic, data, retain in frames]


def test_fedproto_prototypes_go_once_per_step_and_tasks_carry_only_the_digest(
    mosquitto, tmp_path: Path
) -> None:
    # Prepare
    cfg = config(tmp_path, rounds=3, run_id="bcast")
    frames: Frames = []
    lock = threading.Lock()

    def factory(client_id: str, will: Any) -> MqttTransport:
        return RecordingMqtt(
            frames, lock, client_id=f"edgefl-{client_id}", port=mosquitto.port, will=will
        )

    # Execute
    result = simulate(cfg, FLEET, transport_factory=factory)
    sent = decoded(frames, lock)
    # Assert: round 1 has no prototypes yet; rounds 2, 3 and the final phase share them
    topics = Topics(cfg.federation)
    knowledge = [(env, retain) for t, env, retain in sent if t == topics.bcast("knowledge")]
    assert [env.body.round for env, _ in knowledge] == [2, 3, 4]
    assert all(retain and env.sender == "coordinator" for env, retain in knowledge)
    by_round = {env.body.round: env.body for env, _ in knowledge}
    tasks = [env.body for _, env, _ in sent if isinstance(env.body, Task)]
    assert len(tasks) == 3 * 4
    for task in tasks:
        if task.round == 1:
            assert task.shared == b"" and task.payloads == {}
        else:
            assert task.shared == by_round[task.round].digest and task.payloads == {}
            assert list(by_round[task.round].payloads) == ["protos"]
    assert not any(isinstance(env.body, Fetch) for _, env, _ in sent)
    # the coordinator counts the knowledge once per step, in the step's bytes
    assert [m["bytes"].get("tx.knowledge", 0) > 0 for m in result.metrics] == [
        False,
        True,
        True,
        True,
    ]
    assert all(len(m["agents"]) == 3 for m in result.metrics)


class MqttAgent:
    """One agent on Mosquitto that can go away quietly (a clean disconnect: no last will, so
    the coordinator still counts it online) and come back with or without its session."""

    def __init__(self, cfg: RunConfig, index: int, port: int, frames: Frames, lock: threading.Lock):
        self.cfg, self.port, self.frames, self.lock = cfg, port, frames, lock
        self.opts = agent_options(cfg, FLEET, index)
        self.agent: EdgeAgent | None = None
        self.transport: MqttTransport | None = None
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()

    def start(self, *, clean: bool = False) -> MqttAgent:
        self.stop = threading.Event()
        self.transport = RecordingMqtt(
            self.frames,
            self.lock,
            client_id=f"edgefl-{self.opts.device_id}",
            port=self.port,
            will=agent_will(self.cfg.federation, self.opts.device_id),
            clean_session=clean,
        )
        self.agent = build_agent(self.opts, self.transport)
        self.agent.start()  # subscriptions first: what the session queued arrives on connect
        self.transport.connect()
        self.thread = threading.Thread(target=self.agent.run, args=(self.stop,), daemon=True)
        self.thread.start()
        return self

    def leave(self) -> None:
        assert self.transport is not None and self.thread is not None
        self.stop.set()
        self.thread.join(timeout=60)
        self.transport.close()


def test_late_reconnecting_and_fetching_agents_all_finish(
    mosquitto, tmp_path: Path, monkeypatch
) -> None:
    # Prepare: at round 2 two agents go away just before the knowledge is published and come
    # back after it: agent1 with its broker session (the knowledge and the task are queued
    # there), agent2 with a new one (it gets the retained knowledge on subscribing, the task
    # again when it registers). At round 3 agent0 goes away and the retained knowledge is
    # cleared before it comes back with a new session: it must fetch.
    cfg = config(tmp_path, rounds=3, run_id="bcast-late", rejoin_wait_s=30.0)
    topics = Topics(cfg.federation)
    frames: Frames = []
    lock = threading.Lock()
    agents = [MqttAgent(cfg, i, mosquitto.port, frames, lock) for i in range(3)]
    comebacks: list[threading.Thread] = []
    original = KnowledgeBroadcast.publish

    def come_back(agent: MqttAgent, clean: bool) -> None:
        comebacks.append(threading.Thread(target=agent.start, kwargs={"clean": clean}))
        comebacks[-1].start()

    def publish(self: KnowledgeBroadcast, knowledge: Knowledge) -> None:
        if knowledge.round == 2:
            agents[1].leave()
            agents[2].leave()
            original(self, knowledge)
            come_back(agents[1], clean=False)
            come_back(agents[2], clean=True)
        elif knowledge.round == 3:
            agents[0].leave()
            original(self, knowledge)
            self.endpoint.transport.publish(topics.bcast("knowledge"), b"", retain=True)
            come_back(agents[0], clean=True)
        else:
            original(self, knowledge)

    monkeypatch.setattr(KnowledgeBroadcast, "publish", publish)
    for agent in agents:
        agent.start()
    coord_transport = RecordingMqtt(
        frames,
        lock,
        client_id="edgefl-coordinator",
        port=mosquitto.port,
        will=coordinator_will(cfg),
    )
    # Execute
    try:
        result = run_coordinator(cfg, coord_transport)
    finally:
        for t in comebacks:
            t.join(timeout=60)
        for agent in agents:
            agent.leave()
        coord_transport.close()
    # Assert: every step has all three replies
    assert [sorted(m["agents"]) for m in result.metrics] == [AGENTS] * 4
    assert all(not m["failed"] for m in result.metrics)
    sent = decoded(frames, lock)
    fetches = Counter((env.sender, env.body.digest) for _, env, _ in sent if env.kind == "fetch")
    answers = [(t, env.body) for t, env, _ in sent if env.kind == "knowledge" and "/dev/" in t]
    round3 = next(env.body for t, env, _ in sent if env.kind == "knowledge" and env.round == 3)
    # only agent0, at round 3, had to ask; the coordinator answered it on its own topic
    assert set(fetches) == {("agent0", round3.digest)}
    assert [(t, k.digest) for t, k in answers] == [
        (topics.down("agent0", "knowledge"), round3.digest)
    ] * len(answers) and answers
    # the late agents got round 2's knowledge without asking: one broadcast, no answers
    bcasts = [env.body.round for t, env, _ in sent if t == topics.bcast("knowledge")]
    assert bcasts == [2, 3, 4]
