"""Buffered (semi-asynchronous) rounds over a real Mosquitto, with scripted FedProto devices.

Two fast devices and a slow one. A buffered step closes once ``buffer_size`` replies are in;
the slow device's reply to a task of an earlier round is folded into a later step with its
staleness weight, or refused with its reason when it is more than ``run.max_staleness``
rounds old.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import unique_id, wait_for
from helpers_mqtt import ScriptedAgent, proto_reply

from coordinator.broker.embedded import MosquittoBroker
from coordinator.config import load_config
from coordinator.engine.core import RunResult
from coordinator.engine.runner import run_coordinator
from coordinator.store.database import Store
from protocol.contract.messages import Reply, Task
from protocol.contract.payloads import PrototypeSet
from protocol.transport.paho import MqttTransport

pytestmark = pytest.mark.network

FED = "buffered"
DIM = 16
WAIT_S = 60.0


def protos(value: float) -> PrototypeSet:
    """Prototypes of classes 0 and 1, every coordinate ``value``."""
    return PrototypeSet(np.array([0, 1]), np.full((2, DIM), value, np.float32), np.array([5, 5]))


def answer(values: dict[int, float], before: dict[int, threading.Event] | None = None):
    """A script: round r's training task answered with prototypes ``values[r]`` once
    ``before[r]`` is set (``None``: at once); ``final`` answered at once."""

    def script(task: Task) -> Reply | None:
        if task.phase != "train":
            return proto_reply(task)
        gate = (before or {}).get(task.round)
        if gate is not None:
            assert gate.wait(WAIT_S), f"round {task.round} never let its reply go"
        return proto_reply(task, protos(values[task.round]))

    return script


def on_ack(agent: ScriptedAgent, count: int) -> threading.Event:
    """Set once ``agent`` holds ``count`` acks of its replies."""
    done = threading.Event()

    def watch() -> None:
        if wait_for(lambda: len(agent.acks) >= count, WAIT_S):
            done.set()

    threading.Thread(target=watch, daemon=True).start()
    return done


def run_buffered(
    mosquitto: MosquittoBroker,
    tmp_path: Path,
    cast: Callable[[], list[ScriptedAgent]],
    **run: object,
) -> tuple[RunResult, list[dict]]:
    cfg = load_config(
        None,
        [],
        algorithm="fedproto",
        rounds=2,
        run_dir=str(tmp_path / "run"),
        run_id="buf",
        federation=FED,
        min_agents=3,
        deadline_s=WAIT_S,
        mode="buffered",
        buffer_size=2,
        staleness="polynomial",
        staleness_a=1.0,
        **run,
    )
    coord_t = MqttTransport(client_id=unique_id("coord"), port=mosquitto.port)
    outcome: dict[str, RunResult] = {}
    coord = threading.Thread(target=lambda: outcome.update(run=run_coordinator(cfg, coord_t)))
    agents: list[ScriptedAgent] = []
    try:
        coord.start()
        assert wait_for(lambda: coord_t.connected, 30)
        agents = [a.start() for a in cast()]
        coord.join(4 * WAIT_S)
        assert not coord.is_alive() and "run" in outcome, "the run did not finish"
    finally:
        coord_t.close()
        for a in agents:
            a.close()
    text = (tmp_path / "run" / "metrics.jsonl").read_text()
    return outcome["run"], [json.loads(x) for x in text.splitlines() if x]


def global_protos(tmp_path: Path) -> PrototypeSet:
    store = Store(tmp_path / "run" / "state.sqlite")
    try:
        p = store.global_state()["protos"]
    finally:
        store.close()
    assert isinstance(p, PrototypeSet)
    return p


def test_a_slow_devices_reply_is_folded_into_a_later_round_with_its_staleness_weight(
    mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    # Prepare: a0 and a1 answer round 1 at once (1.0); a2 answers round 1 (4.0) only once
    # round 2 has a0's reply (2.0), so its reply is one version old when round 2 folds it;
    # a1 answers round 2 only after that, when the step is closed
    gates: dict[str, dict[int, threading.Event]] = {}

    def cast() -> list[ScriptedAgent]:
        a0 = ScriptedAgent(mosquitto.port, FED, "a0", answer({1: 1.0, 2: 2.0}), feature_dim=DIM)
        a2_gate = on_ack(a0, 2)
        a2 = ScriptedAgent(
            mosquitto.port, FED, "a2", answer({1: 4.0, 2: 4.0}, {1: a2_gate}), feature_dim=DIM
        )
        a1 = ScriptedAgent(
            mosquitto.port, FED, "a1", answer({1: 1.0, 2: 1.0}, {2: on_ack(a2, 1)}), feature_dim=DIM
        )
        gates["a2"] = {1: a2_gate}
        return [a0, a1, a2]

    # Execute
    result, records = run_buffered(mosquitto, tmp_path, cast, max_staleness=2)
    # Assert: round 2 folded a0's fresh reply and a2's one-round-old one, weighted
    # (1 + s)^-1 = 1/2 (FedProto's per-class mean, weighted by staleness)
    r1, r2 = records[0], records[1]
    assert r1["mode"] == "buffered" and sorted(r1["agents"]) == ["a0", "a1"]
    assert r1["in_flight"] == ["a2"]
    assert r2["staleness"] == {"a0": 0, "a2": 1}
    assert r2["staleness_weight"] == {"a0": 1.0, "a2": 0.5}
    expected = (1.0 * 2.0 + 0.5 * 4.0) / (1.0 + 0.5)
    np.testing.assert_allclose(global_protos(tmp_path).vectors, expected, rtol=1e-6)
    assert result.rejected.get("stale", 0) == 0


def test_a_reply_past_the_staleness_bound_is_refused_with_its_reason(
    mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    # Prepare: max_staleness 0. a2 holds its round-1 reply until round 2 has opened (its
    # round-1 task is then too old: it gets a fresh round-2 task at once), then answers both
    got_fresh = threading.Event()
    holder: dict[str, ScriptedAgent] = {}

    def slow(task: Task) -> Reply | None:
        if task.phase != "train":
            return proto_reply(task)
        if task.round == 1:
            assert got_fresh.wait(WAIT_S), "a2 never got a fresh task"
            return proto_reply(task, protos(9.0))
        got_fresh.set()
        assert wait_for(lambda: len(holder["a2"].acks) >= 1, WAIT_S)  # after the stale one
        return proto_reply(task, protos(3.0))

    def cast() -> list[ScriptedAgent]:
        a0 = ScriptedAgent(mosquitto.port, FED, "a0", answer({1: 1.0, 2: 1.0}), feature_dim=DIM)
        a2 = holder["a2"] = ScriptedAgent(mosquitto.port, FED, "a2", slow, feature_dim=DIM)
        a1 = ScriptedAgent(
            mosquitto.port, FED, "a1", answer({1: 1.0, 2: 1.0}, {2: on_ack(a2, 2)}), feature_dim=DIM
        )
        return [a0, a1, a2]

    # Execute
    result, records = run_buffered(mosquitto, tmp_path, cast, max_staleness=0)
    # Assert: the round-1 reply was refused with the bound in its reason; the fresh one folded
    first = holder["a2"].acks[0]
    assert not first.accepted
    assert "stale" in first.reason and "run.max_staleness 0" in first.reason, first.reason
    assert result.rejected["stale"] == 1
    r2 = records[1]
    assert r2["stale_refused"] == ["a2"]
    assert r2["staleness"] == {"a0": 0, "a2": 0}
    np.testing.assert_allclose(global_protos(tmp_path).vectors, (1.0 + 3.0) / 2, rtol=1e-6)
