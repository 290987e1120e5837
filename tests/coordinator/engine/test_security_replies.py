"""One forged reply as another device must not reach the global state.

On a real Mosquitto, a coordinator with default settings runs FedProto for one round. Device
``a0`` replies honestly with 16-dimensional prototypes; a forger then answers ``a1``'s task as
``a1`` with prototypes of another dimension (round 1 used to check none, and aggregation then
failed) or with finite 1e30 values (which used to put 3e29 into the global prototypes). The
forged reply must be refused with a precise reason and the global state must stay finite.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import unique_id, wait_for

from coordinator.broker.embedded import MosquittoBroker
from coordinator.config import load_config
from coordinator.engine.core import RunResult
from coordinator.engine.runner import run_coordinator
from coordinator.store.database import Store
from coordinator.strategies import AgentInfo, Step, create_strategy
from protocol.algorithms import config_type
from protocol.contract.codec import Envelope
from protocol.contract.messages import Ack, Capabilities, InputSpec, Register, Reply, Task
from protocol.contract.payloads import PrototypeSet, TensorMap
from protocol.contract.topics import Topics
from protocol.errors import ValidationError
from protocol.transport.endpoint import Endpoint
from protocol.transport.paho import MqttTransport

pytestmark = pytest.mark.network

FED = "sec2"
T = Topics(FED)
DIM = 16


def _protos(dim: int = DIM, scale: float = 1.0) -> PrototypeSet:
    vectors = np.random.default_rng(dim).standard_normal((2, dim)).astype(np.float32) * scale
    return PrototypeSet(np.array([0, 1]), vectors, np.array([5, 5]))


class ScriptedAgent:
    """A device speaking the real protocol over MQTT, with a scripted answer to each task."""

    def __init__(
        self, port: int, device_id: str, answer: Callable[[Task], Reply | None], *, as_id: str = ""
    ) -> None:
        self.device_id, self.answer = device_id, answer
        sender = as_id or device_id
        self.transport = MqttTransport(client_id=unique_id(sender), port=port)
        self.endpoint = Endpoint(self.transport, sender=sender, federation=FED)
        self.acks: list[Ack] = []
        self.sent: list[str] = []  # msg ids of the replies sent
        self.acked = threading.Event()
        self.endpoint.subscribe(f"{T.base}/dev/{device_id}/down/#", self._on_message)

    def start(self, register: bool = True) -> ScriptedAgent:
        self.transport.connect()
        if register:
            reg = Register(
                device_id=self.device_id,
                arch="mlp_s",
                num_params=100,
                capabilities=Capabilities(device="cpu"),
                input_spec=InputSpec(1, 8, 8),
                num_classes=10,
                class_counts={"0": 5, "1": 5},
                algorithm="fedproto",
            )
            self.endpoint.send(T.up(self.device_id, "register"), reg)
        return self

    def _on_message(self, env: Envelope, topic: str) -> None:
        body = env.body
        if isinstance(body, Task):
            reply = self.answer(body)
            if reply is not None:
                sent = self.endpoint.send(T.up(self.device_id, "reply"), reply, round=body.round)
                self.sent.append(sent.msg_id)
        elif isinstance(body, Ack) and body.ref_id in self.sent:
            self.acks.append(body)
            self.acked.set()

    def close(self) -> None:
        self.endpoint.close()
        self.transport.close()


def _reply(task: Task, protos: PrototypeSet | None = None) -> Reply:
    payloads = {"protos": protos} if protos is not None and task.phase == "train" else {}
    return Reply(
        task_id=task.task_id, round=task.round, phase=task.phase, num_samples=10, payloads=payloads
    )


@pytest.mark.parametrize(
    ("forged", "reason"),
    [
        (_protos(dim=7), "dimension 16"),  # round 1: the step's first valid reply fixed 16
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
        return _reply(task, _protos())

    def a1_answer(task: Task) -> Reply | None:
        return _reply(task) if task.phase == "final" else None

    def forge(task: Task) -> Reply | None:
        if task.phase != "train":
            return None
        assert honest_done.wait(30), "a0's reply was never acknowledged"
        return _reply(task, forged)

    a0 = ScriptedAgent(mosquitto.port, "a0", honest)
    a1 = ScriptedAgent(mosquitto.port, "a1", a1_answer)
    forger = ScriptedAgent(mosquitto.port, "a1", forge, as_id="a1")
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


def _agent(device_id: str) -> AgentInfo:
    reg = Register(
        device_id=device_id,
        arch="mlp_s",
        num_params=100,
        capabilities=Capabilities(device="cpu"),
        input_spec=InputSpec(1, 8, 8),
        num_classes=10,
        class_counts={"0": 5, "1": 5},
        algorithm="fedproto",
    )
    return AgentInfo(device_id, reg)


def _train_reply(protos: PrototypeSet) -> Reply:
    return Reply(task_id="t", round=1, phase="train", num_samples=10, payloads={"protos": protos})


@pytest.mark.parametrize("algorithm", ["fedproto", "fedvtc"])
def test_round_one_dimension_is_fixed_per_step_by_the_first_valid_reply(algorithm: str) -> None:
    s = create_strategy(algorithm, config_type(algorithm)(), num_classes=10)
    sd = np.ones(DIM, np.float32)
    good = PrototypeSet(np.array([0, 1]), _protos().vectors, np.array([5, 5]), sd=sd)
    other = PrototypeSet(np.array([0]), np.ones((1, 7), np.float32), np.array([5]), sd=sd[:7])
    step1, step2 = Step(1, "train"), Step(2, "train")
    s.validate(step1, _agent("a0"), _train_reply(good))
    with pytest.raises(ValidationError, match="dimension 16"):
        s.validate(step1, _agent("a1"), _train_reply(other))
    s.validate(step2, _agent("a1"), _train_reply(other))  # a new step without state: a new pin


def test_model_tensors_are_bounded_too() -> None:
    s = create_strategy("fedavg", config_type("fedavg")(), num_classes=10)
    w = TensorMap({"fc.weight": np.full((2, 2), 1e30, np.float32), "n": np.array(10**9)})
    reply = Reply(task_id="t", round=1, phase="train", num_samples=1, payloads={"weights": w})
    with pytest.raises(
        ValidationError, match=r"weights\.tensors\.fc\.weight.*\|value\| <= 1000000"
    ):
        s.check_values(reply)  # the engine's bound for every algorithm, before validate
