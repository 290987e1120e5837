"""One forged reply as another device must not reach the global state.

On a real Mosquitto, a coordinator with default settings runs FedProto for one round. Device
``a0`` replies honestly with 16-dimensional prototypes; a forger then answers ``a1``'s task as
``a1`` with prototypes of another dimension than the devices registered (aggregation would
fail) or with finite 1e30 values (which used to put 3e29 into the global prototypes). The
forged reply must be refused with a precise reason and the global state must stay finite.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers import unique_id, wait_for
from helpers_mqtt import ScriptedAgent, fedproto_register, proto_reply, prototypes

from coordinator.broker.embedded import MosquittoBroker
from coordinator.config import load_config
from coordinator.engine.core import RunResult
from coordinator.engine.runner import run_coordinator
from coordinator.store.database import Store
from coordinator.strategies import AgentInfo, Step, create_strategy
from protocol.algorithms import config_type
from protocol.contract.messages import Reply, Task
from protocol.contract.payloads import PrototypeSet, TensorMap
from protocol.errors import ValidationError
from protocol.transport.paho import MqttTransport

pytestmark = pytest.mark.network

FED = "sec2"
DIM = 16


def _protos(dim: int = DIM, scale: float = 1.0) -> PrototypeSet:
    return prototypes(dim, scale)


@pytest.mark.parametrize(
    ("forged", "reason"),
    [
        (_protos(dim=7), "dimension 16"),  # round 1: the size the devices registered
        (_protos(scale=1e30), "|value| <= 10000"),
    ],
    ids=["other-dimension", "huge-values"],
)
def test_a_forged_reply_is_refused_and_the_global_state_stays_finite(
    mosquitto: MosquittoBroker, tmp_path: Path, forged: PrototypeSet, reason: str
) -> None:
    # Set up: an honest a0, a1 that never gets to answer its training task, a forger as a1
    honest_done = threading.Event()

    def honest(task: Task) -> Reply:
        return proto_reply(task, _protos())

    def a1_answer(task: Task) -> Reply | None:
        return proto_reply(task) if task.phase == "final" else None

    def forge(task: Task) -> Reply | None:
        if task.phase != "train":
            return None
        assert honest_done.wait(30), "a0's reply was never acknowledged"
        return proto_reply(task, forged)

    a0 = ScriptedAgent(mosquitto.port, FED, "a0", honest, feature_dim=DIM)
    a1 = ScriptedAgent(mosquitto.port, FED, "a1", a1_answer, feature_dim=DIM)
    forger = ScriptedAgent(mosquitto.port, FED, "a1", forge, as_id="a1")
    threading.Thread(target=lambda: honest_done.set() if a0.acked.wait(30) else None).start()
    cfg = load_config(
        None,
        [],
        algorithm="fedproto",
        rounds=1,
        run_dir=str(tmp_path / "run"),
        run_id="sec",
        federation=FED,
        min_agents=2,
        deadline_s=60.0,
    )
    coord_t = MqttTransport(client_id=unique_id("coord"), port=mosquitto.port)
    outcome: dict[str, RunResult] = {}
    coord = threading.Thread(target=lambda: outcome.update(run=run_coordinator(cfg, coord_t)))
    try:
        # Execute: the shipped coordinator loop, default settings; devices join once it listens
        coord.start()
        assert wait_for(lambda: coord_t.connected, 30)
        forger.start(register=False)
        a0.start()
        a1.start()
        coord.join(120)
        assert not coord.is_alive() and "run" in outcome, "the run did not finish"
        result = outcome["run"]
    finally:
        coord_t.close()
        for agent in (a0, a1, forger):
            agent.close()

    # Verify: the forgery was refused with its reason; the round aggregated finite prototypes
    assert forger.acks and not forger.acks[0].accepted
    assert reason in forger.acks[0].reason, forger.acks[0].reason
    assert result.rejected.get("invalid_reply") == 1
    records = [
        json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n") if x
    ]
    assert [r.get("status", "done") for r in records] == ["done", "done"]
    store = Store(tmp_path / "run" / "state.sqlite")
    try:
        protos = store.global_state()["protos"]
    finally:
        store.close()
    assert isinstance(protos, PrototypeSet) and protos.dim == DIM
    assert np.isfinite(protos.vectors).all() and np.abs(protos.vectors).max() < 100


def _agent(device_id: str, feature_dim: int = 0) -> AgentInfo:
    return AgentInfo(device_id, fedproto_register(device_id, feature_dim))


def _train_reply(protos: PrototypeSet) -> Reply:
    return Reply(task_id="t", round=1, phase="train", num_samples=10, payloads={"protos": protos})


@pytest.mark.parametrize("algorithm", ["fedproto", "fedvtc"])
def test_round_one_dimension_is_the_one_most_participants_registered(algorithm: str) -> None:
    s = create_strategy(algorithm, config_type(algorithm)(), num_classes=10)
    sd = np.ones(DIM, np.float32)
    good = PrototypeSet(np.array([0, 1]), _protos().vectors, np.array([5, 5]), sd=sd)
    other = PrototypeSet(np.array([0]), np.ones((1, 7), np.float32), np.array([5]), sd=sd[:7])
    fleet = [_agent("a0", DIM), _agent("a1", DIM), _agent("a2", 7), _agent("a3")]
    s.observe_fleet(fleet)
    with pytest.raises(ValidationError, match="dimension 16"):
        s.validate(Step(1, "train"), fleet[0], _train_reply(other))  # first: it fixes nothing
    s.validate(Step(1, "train"), fleet[1], _train_reply(good))
    with pytest.raises(ValidationError, match="dimension 16"):
        s.validate(Step(1, "train"), fleet[2], _train_reply(other))  # the minority's size
    s.observe_fleet([fleet[3]])  # nobody told: nothing to check against
    s.validate(Step(1, "train"), fleet[3], _train_reply(other))


def test_model_tensors_are_bounded_too() -> None:
    s = create_strategy("fedavg", config_type("fedavg")(), num_classes=10)
    w = TensorMap({"fc.weight": np.full((2, 2), 1e30, np.float32), "n": np.array(10**9)})
    reply = Reply(task_id="t", round=1, phase="train", num_samples=1, payloads={"weights": w})
    with pytest.raises(
        ValidationError, match=r"weights\.tensors\.fc\.weight.*\|value\| <= 1000000"
    ):
        s.check_values(reply)  # the engine's bound for every algorithm, before validate
