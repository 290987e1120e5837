"""Felo and Velo end to end over a real Mosquitto.

Four in-process agents, two of them with the same architecture. Every frame any party
publishes is recorded on its way to the broker, decoded and checked against the spec's message
table (felo_velo.md §2.2): M1 = the group model of the agent's architecture (once the group has
one) and, after warm-up, the server's per-class knowledge; M2 = class-wise feature and logit
means of the held classes with their counts, and the whole model. A coordinator killed mid-run
and restarted resumes with the same knowledge table and CVAE.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.config import RunConfig
from coordinator.engine.runner import coordinator_will, make_coordinator
from coordinator.sim.simulate import FleetSpec, agent_options, agent_will, simulate
from coordinator.strategies.felo.strategy import VeloStrategy
from edge_agent.factory import build_agent
from protocol.contract.codec import decode
from protocol.contract.payloads import FeatureLogitSet, TensorMap
from protocol.transport.paho import MqttTransport
from tests.coordinator.strategies.test_fedvtc_mqtt import RecordingMqtt, Wire
from tests.helpers_runtime import run_config

pytestmark = [pytest.mark.network, pytest.mark.slow]

ROUNDS, C, D = 4, 10, 16
FLEET = FleetSpec(
    num_agents=4,
    models=("mlp_s", "cnn_t1", "mlp_s", "mlp_m"),  # agent0 and agent2 share an architecture
    data="digits",
    partition="dirichlet:1.0",
    feature_dim=D,
    global_test_size=200,
)
AGENTS = ["agent0", "agent1", "agent2", "agent3"]
SMALL_CVAE = {"cvae_z_dim": 8, "cvae_embed_dim": 8, "cvae_hidden": 32, "cvae_epochs": 2}


def config(tmp_path: Path, algorithm: str, **hyper: Any) -> RunConfig:
    cfg = run_config(tmp_path, algorithm, rounds=ROUNDS, run_id=f"{algorithm}-mqtt", min_agents=4)
    return cfg.replace(hyper={**cfg.hyper, "batch_size": 16, **hyper})


def knowledge(payloads: dict[str, Any]) -> FeatureLogitSet:
    k = payloads["knowledge"]
    assert isinstance(k, FeatureLogitSet)
    return k


def check_m2(wire: Wire, r: int) -> None:
    """Means of exactly the held classes, one count per training sample, and the model."""
    for device, reply in wire.replies[(r, "train")].items():
        assert set(reply.payloads) == {"knowledge", "weights"}
        k = knowledge(reply.payloads)
        assert k.class_ids.tolist() == wire.held[device]
        assert k.features.shape == (len(wire.held[device]), D) and k.logits.shape[1] == C
        assert k.features.dtype == np.float32 and k.counts.sum() == reply.num_samples
        assert np.isfinite(k.features).all() and np.isfinite(k.logits).all()
        assert isinstance(reply.payloads["weights"], TensorMap)


def check_m1(wire: Wire, r: int, algorithm: str) -> None:
    """Group models: the sample-weighted mean of last round's group members, identical for the
    two mlp_s agents; knowledge from round 2 on: the mean of every entry so far (history)."""
    tasks, prev = wire.tasks[(r, "train")], wire.replies[(r - 1, "train")]
    if r == 1:
        assert all(t.payloads == {} for t in tasks.values())
        return
    w0, w2 = (tasks[a].payloads["weights"] for a in ("agent0", "agent2"))
    assert isinstance(w0, TensorMap) and isinstance(w2, TensorMap)
    assert w0.tensors.keys() == w2.tensors.keys()
    for name, value in w0.tensors.items():
        np.testing.assert_array_equal(value, w2.tensors[name])  # same start, same group
        ups = [prev[a] for a in ("agent0", "agent2")]
        maps = [u.payloads["weights"] for u in ups]
        n = np.array([u.num_samples for u in ups], np.float64)
        expect = sum(
            ni / n.sum() * m.tensors[name].astype(np.float64)
            for ni, m in zip(n, maps, strict=True)
            if isinstance(m, TensorMap)
        )
        if value.dtype.kind == "f":
            np.testing.assert_allclose(value, expect, rtol=1e-5, atol=1e-6)
    w1 = tasks["agent1"].payloads["weights"]
    assert isinstance(w1, TensorMap) and w1.tensors.keys() != w0.tensors.keys()
    entries = [
        knowledge(reply.payloads)
        for rr in range(1, r)
        for reply in wire.replies[(rr, "train")].values()
    ]
    for task in tasks.values():
        k = knowledge(task.payloads)
        everyone = sorted({c for e in entries for c in e.class_ids.tolist()})
        assert k.class_ids.tolist() == everyone
        for i, c in enumerate(everyone):
            rows = [e.logits[e.class_ids.tolist().index(c)] for e in entries if c in e.class_ids]
            np.testing.assert_allclose(k.logits[i], np.mean(rows, axis=0), rtol=1e-4, atol=1e-5)
            feats = [e.features[e.class_ids.tolist().index(c)] for e in entries if c in e.class_ids]
            same = np.allclose(k.features[i], np.mean(feats, axis=0), rtol=1e-4, atol=1e-5)
            assert same == (algorithm == "felo")  # Velo sends CVAE samples instead


@pytest.mark.parametrize("algorithm", ["felo", "velo"])
def test_felo_and_velo_over_mosquitto(mosquitto, tmp_path: Path, algorithm: str) -> None:
    # Prepare: warm-up = max(1, round(0.05 * 4)) = 1 round
    cfg = config(tmp_path, algorithm, **(SMALL_CVAE if algorithm == "velo" else {}))
    frames: list[tuple[str, bytes]] = []
    lock = threading.Lock()

    def factory(client_id: str, will: Any) -> MqttTransport:
        return RecordingMqtt(
            frames, lock, client_id=f"edgefl-{client_id}", port=mosquitto.port, will=will
        )

    # Execute
    result = simulate(cfg, FLEET, transport_factory=factory)
    with lock:
        wire = Wire([(topic, decode(data), len(data)) for topic, data in frames])
    # Assert
    steps = result.metrics
    assert [(m["round"], m["phase"]) for m in steps] == [
        (r, "train") for r in range(1, ROUNDS + 1)
    ] + [(ROUNDS + 1, "final")]
    for r in range(1, ROUNDS + 1):
        assert sorted(wire.replies[(r, "train")]) == AGENTS
        check_m2(wire, r)
        check_m1(wire, r, algorithm)
        wire.counted(steps[r - 1], "tx", r, "train")
        wire.counted(steps[r - 1], "rx", r, "train")
    if algorithm == "velo":  # trained after the warm-up round and every round after
        assert [int(s["aggregate"].get("cvae_steps", 0)) > 0 for s in steps[:ROUNDS]] == [
            True
        ] * ROUNDS
        assert all(np.isfinite(s["aggregate"]["cvae_kl_per_dim"]) for s in steps[:ROUNDS])
    # the final task hands every agent its group model; accuracies are finite
    assert all(np.isfinite(a["acc_global"]) for a in steps[-1]["agents"].values())


def start_agent(
    cfg: RunConfig, i: int, port: int, stop: threading.Event
) -> tuple[MqttTransport, threading.Thread]:
    """Agent ``i`` of FLEET over Mosquitto, running in a thread until ``stop``."""
    opts = agent_options(cfg, FLEET, i)
    t = MqttTransport(
        client_id=f"edgefl-{opts.device_id}",
        port=port,
        will=agent_will(cfg.federation, opts.device_id),
    )
    agent = build_agent(opts, t)
    t.connect()
    agent.start()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    return t, thread


class CrashError(Exception):
    """Raised inside the coordinator's wait loop to kill it mid-run."""


def test_velo_coordinator_restart_resumes_with_the_same_table_and_cvae(
    mosquitto, tmp_path: Path
) -> None:
    # Prepare: four agents over Mosquitto that outlive the first coordinator
    cfg = config(tmp_path, "velo", **SMALL_CVAE)
    stop = threading.Event()
    agents = [start_agent(cfg, i, mosquitto.port, stop) for i in range(FLEET.num_agents)]

    def transport() -> MqttTransport:
        return MqttTransport(
            client_id="edgefl-coordinator", port=mosquitto.port, will=coordinator_will(cfg)
        )

    first_t = transport()
    first: Any = None

    def crash_after_two_rounds() -> None:
        if first is not None and first.store.last_done_step() >= 2:
            raise CrashError

    try:
        # Execute: the first coordinator dies while round 3 is open
        first = make_coordinator(cfg, first_t, health_check=crash_after_two_rounds)
        first.start()
        first_t.connect()
        with pytest.raises(CrashError):
            first.run()
        at_crash = first.strategy.state_dict()
        first.store.close()
        first_t.abort()  # no clean disconnect: the broker keeps the session
        second_t = transport()
        second = make_coordinator(cfg, second_t)
        restored = second.strategy
        restored_state = restored.state_dict()  # what the restart loaded from the store
        second.start()
        second_t.connect()
        result = second.run()
        second.store.close()
        second_t.close()
    finally:
        stop.set()
        for t, thread in agents:
            thread.join(timeout=30)
            t.close()
    # Assert: the restarted coordinator began from exactly the state the first one had
    assert isinstance(restored, VeloStrategy)
    assert set(restored_state) == set(at_crash)
    for key in ("knowledge", "cvae"):
        a, b = at_crash[key], restored_state[key]
        assert isinstance(a, TensorMap) and isinstance(b, TensorMap)
        assert a.tensors.keys() == b.tensors.keys()
        for name, value in a.tensors.items():
            np.testing.assert_array_equal(value, b.tensors[name])
    cvae_at_crash = at_crash["cvae"]
    assert isinstance(cvae_at_crash, TensorMap)
    rounds = [(m["round"], m["phase"]) for m in result.metrics]
    assert rounds == [(r, "train") for r in range(1, ROUNDS + 1)] + [(ROUNDS + 1, "final")]
    # ...and kept training the same CVAE: the final CVAE differs from the one at the crash
    final_cvae = restored.cvae
    assert final_cvae is not None
    assert any(
        not np.array_equal(final_cvae.tensors[n], cvae_at_crash.tensors[n])
        for n in cvae_at_crash.tensors
    )
