"""FedVTC end to end over a real Mosquitto with 3 in-process agents.

Every frame any party publishes is recorded on its way to the broker, decoded, and checked
against the spec's message table (fedvtc.md §2.2): M1 (prototypes of the held classes + SD
down), M2 (local prototypes of the held classes + SD up), M3 (each generator once, up), M4
(averaged generator, all prototypes, SD down). The coordinator's own byte counts are checked
against the recorded frames, and fine-tuning may not cost more than one point (spec §10.3).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.sim.simulate import simulate
from edge_agent.knowledge_cache import merge
from models.vtc import vtc_for
from protocol.contract.codec import Envelope, decode
from protocol.contract.messages import Knowledge, Register, Reply, Task
from protocol.contract.payloads import PrototypeSet, TensorMap
from protocol.contract.topics import Topics
from protocol.transport.paho import MqttTransport
from tests.helpers_runtime import FLEET, run_config

pytestmark = [pytest.mark.network, pytest.mark.slow]

ROUNDS = 3
P = FLEET.feature_dim or 0  # latent p (16 -> the 4x2x2 VTC at 8x8)
AGENTS = ["agent0", "agent1", "agent2"]


class RecordingMqtt(MqttTransport):
    """An MQTT transport that keeps a copy of every frame it publishes."""

    def __init__(self, frames: list[tuple[str, bytes]], lock: threading.Lock, **kw: Any) -> None:
        super().__init__(**kw)
        self._frames, self._frames_lock = frames, lock

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        if payload:
            with self._frames_lock:
                self._frames.append((topic, bytes(payload)))
        super().publish(topic, payload, qos=qos, retain=retain)


def run_over_mosquitto(port: int, tmp_path: Path) -> tuple[Any, list[tuple[str, Envelope, int]]]:
    cfg = run_config(tmp_path, "fedvtc", rounds=ROUNDS, run_id="vtc-mqtt")
    cfg = cfg.replace(hyper={**cfg.hyper, "synthetic_per_class": 30, "finetune_epochs": 2})
    frames: list[tuple[str, bytes]] = []
    lock = threading.Lock()

    def factory(client_id: str, will: Any) -> MqttTransport:
        return RecordingMqtt(frames, lock, client_id=f"edgefl-{client_id}", port=port, will=will)

    result = simulate(cfg, FLEET, transport_factory=factory)
    with lock:
        return result, [(topic, decode(data), len(data)) for topic, data in frames]


Key = tuple[int, str]  # (round, phase)


class Wire:
    """The recorded frames, decoded and grouped by step."""

    def __init__(self, sent: list[tuple[str, Envelope, int]]) -> None:
        assert not any(env.kind == "chunk" for _, env, _ in sent)  # all fit one frame here
        self.held = {
            env.sender: env.body.present_classes()
            for _, env, _ in sent
            if isinstance(env.body, Register)
        }
        self.tasks: dict[Key, dict[str, Task]] = defaultdict(dict)
        self.replies: dict[Key, dict[str, Reply]] = defaultdict(dict)
        # bytes of the first copy of each task / reply, per (round, phase, kind); at-least-once
        # delivery may legitimately resend one (lost ack, re-registration): those go to resent
        self.size: dict[tuple[int, str, str], int] = defaultdict(int)
        self.resent = 0
        seen: set[tuple[str, str, str]] = set()
        topics = Topics()  # run_config keeps the default federation
        # a step's shared payloads go once on bcast/knowledge: tasks are checked
        # as the agent runs them, merged with it, and its bytes count with the step's tasks
        knowledge = self._knowledge(sent)
        for topic, env, n in sent:
            body = env.body
            if not isinstance(body, (Task, Reply)):
                continue
            key = (env.kind, env.sender, body.task_id)
            if key in seen:
                self.resent += n
                continue
            seen.add(key)
            if isinstance(body, Task):
                device = topics.device_from(topic)
                assert device is not None and topic == topics.down(device, "task")
                if body.shared:  # its bytes count with the first step that names it
                    k, size = knowledge.get(body.shared, (None, 0))
                    knowledge[body.shared] = (k, 0)
                    self.size[(body.round, body.phase, "knowledge")] += size
                    body = merge(body, k)
                self.tasks[(body.round, body.phase)][device] = body
            else:
                self.replies[(body.round, body.phase)][env.sender] = body
            self.size[(body.round, body.phase, env.kind)] += n

    def _knowledge(self, sent: list[tuple[str, Envelope, int]]) -> dict[bytes, tuple[Any, int]]:
        """Each knowledge's first copy and its bytes; later copies (fetch answers) resent."""
        out: dict[bytes, tuple[Any, int]] = {}
        for _topic, env, n in sent:
            if isinstance(env.body, Knowledge):
                if env.body.digest in out:
                    self.resent += n
                else:
                    out[env.body.digest] = (env.body, n)
        return out

    def counted(self, step: dict[str, Any], direction: str, r: int, phase: str) -> int:
        """The coordinator's count for one step and kind (tasks with their knowledge),
        checked against the recorded frames: every first copy, plus at most the resent
        copies; returns the count."""
        kinds = ("task", "knowledge") if direction == "tx" else ("reply",)
        got = sum(int(step["bytes"].get(f"{direction}.{k}", 0)) for k in kinds)
        want = sum(self.size[(r, phase, k)] for k in kinds)
        assert want <= got <= want + self.resent
        return got


def check_m2(wire: Wire, r: int) -> None:
    """Replies carry the local prototypes of exactly the held classes, and sigma."""
    for device, reply in wire.replies[(r, "train")].items():
        assert set(reply.payloads) == {"protos"}
        protos = reply.payloads["protos"]
        assert isinstance(protos, PrototypeSet)
        assert protos.class_ids.tolist() == wire.held[device]
        assert protos.vectors.shape == (len(wire.held[device]), P)
        assert protos.vectors.dtype == np.float32 and protos.sd is not None
        assert protos.sd.shape == (P,) and protos.sd.dtype == np.float32
        assert np.isfinite(protos.vectors).all() and (protos.sd > 0).all()


def check_m1(wire: Wire, r: int) -> None:
    """Nothing in round 1; then the held classes' global prototypes (plain means of last
    round's holders) and the global sigma (plain mean of last round's)."""
    prev = wire.replies[(r - 1, "train")]
    for device, task in wire.tasks[(r, "train")].items():
        assert task.algorithm == "fedvtc" and "generator" not in task.payloads
        if r == 1:
            assert task.payloads == {}
            continue
        protos = task.payloads["protos"]
        assert isinstance(protos, PrototypeSet) and protos.sd is not None
        assert protos.class_ids.tolist() == wire.held[device]  # never a class it lacks
        assert protos.vectors.shape == (len(wire.held[device]), P) and protos.sd.shape == (P,)
        for i, c in enumerate(protos.class_ids.tolist()):
            vecs = [_protos(p).as_dict()[c] for p in prev.values() if c in _protos(p).as_dict()]
            np.testing.assert_allclose(
                protos.vectors[i], np.mean(vecs, axis=0), rtol=1e-5, atol=1e-6
            )
        sds = [_protos(p).sd for p in prev.values()]
        np.testing.assert_allclose(protos.sd, np.mean(sds, axis=0), rtol=1e-5)


def _protos(reply: Reply) -> PrototypeSet:
    out = reply.payloads["protos"]
    assert isinstance(out, PrototypeSet)
    return out


def check_m3_m4(wire: Wire) -> int:
    """One generator upload per agent (BN buffers included); the broadcast is their mean with
    all prototypes and sigma. Returns the float32 size of one generator."""
    uploads = wire.replies[(ROUNDS + 1, "upload_generator")]
    assert sorted(uploads) == AGENTS
    gen_keys = set(vtc_for(P, 1, 8).state_dict())
    for reply in uploads.values():
        gen = reply.payloads["generator"]
        assert isinstance(gen, TensorMap) and set(gen.tensors) == gen_keys
        assert reply.metrics["generator_trained"] == 1.0
    maps = [u.payloads["generator"] for u in uploads.values()]
    assert all(isinstance(m, TensorMap) for m in maps)
    tensors = [m.tensors for m in maps if isinstance(m, TensorMap)]
    assert any(k.endswith("running_var") for k in tensors[0])
    everyone = sorted(set().union(*map(set, wire.held.values())))
    finals = wire.tasks[(ROUNDS + 1, "final")]
    assert sorted(finals) == AGENTS
    for task in finals.values():
        protos, gen = task.payloads["protos"], task.payloads["generator"]
        assert isinstance(protos, PrototypeSet) and isinstance(gen, TensorMap)
        assert protos.class_ids.tolist() == everyone  # all classes, held or not
        assert protos.vectors.shape == (len(everyone), P)
        assert protos.sd is not None and protos.sd.shape == (P,)
        for name, value in gen.tensors.items():
            ups = [t[name] for t in tensors]
            expect = np.mean(ups, axis=0) if value.dtype.kind == "f" else np.max(ups, axis=0)
            np.testing.assert_allclose(value, expect, rtol=1e-5, atol=1e-6)
    # no communication during fine-tuning: the final replies carry metrics only
    assert all(r.payloads == {} for r in wire.replies[(ROUNDS + 1, "final")].values())
    return sum(4 * int(np.prod(t.shape)) for t in tensors[0].values())


def test_fedvtc_rounds_and_finetune_over_mosquitto(mosquitto, tmp_path: Path) -> None:
    # Execute
    result, sent = run_over_mosquitto(mosquitto.port, tmp_path)
    wire = Wire(sent)
    # Assert: the plan (spec §2.2: T rounds, one-shot M3, then M4 + local fine-tuning)
    steps = result.metrics
    assert [(m["round"], m["phase"]) for m in steps] == (
        [(r, "train") for r in range(1, ROUNDS + 1)]
        + [(ROUNDS + 1, "upload_generator"), (ROUNDS + 1, "final")]
    )
    assert all(sorted(m["agents"]) == AGENTS for m in steps)
    assert sorted(wire.held) == AGENTS
    for r in range(1, ROUNDS + 1):
        assert sorted(wire.tasks[(r, "train")]) == sorted(wire.replies[(r, "train")]) == AGENTS
        check_m2(wire, r)
        check_m1(wire, r)
        # byte counts: what the coordinator counted is what went over the wire, and the
        # replies are their float32 prototypes + SD plus a bounded header
        wire.counted(steps[r - 1], "tx", r, "train")
        wire.counted(steps[r - 1], "rx", r, "train")
        floats = sum(4 * P * (len(c) + 1) for c in wire.held.values())
        assert floats < wire.size[(r, "train", "reply")] < floats + 3 * 4096
    gen_bytes = check_m3_m4(wire)
    assert wire.counted(steps[ROUNDS], "rx", ROUNDS + 1, "upload_generator") > 3 * gen_bytes
    # the averaged generator goes down once, on bcast/knowledge, not per agent
    assert wire.counted(steps[-1], "tx", ROUNDS + 1, "final") > gen_bytes
    # accuracy after fine-tuning not more than one point below before (spec §10.3)
    agents = steps[-1]["agents"].values()
    before = [a["acc_global_before_ft"] for a in agents]
    after = [a["acc_global"] for a in agents]
    assert np.isfinite(before).all() and np.isfinite(after).all()
    assert np.mean(after) >= np.mean(before) - 0.01
    assert all(np.isfinite(m["aggregate"]["sigma_mean"]) for m in steps[:ROUNDS])
