"""No single unverified frame may stop, stall or steer a run (``docs/concepts/security.md``,
"Without signing").

The default deployment: the shipped coordinator loop on an anonymous Mosquitto, no signing,
FedProto, three honest devices that register their 16-dimensional features. A forger sees
every task and publishes in any device's name. Each honest device answers a task the forger
targets only once the coordinator has judged the forgery (the forger saw its ack), so the
forgery always comes first.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import unique_id, wait_for
from helpers_mqtt import Forger, ScriptedAgent, fedproto_register, proto_reply, prototypes

from coordinator.broker.embedded import MosquittoBroker
from coordinator.config import load_config
from coordinator.engine.core import RunResult
from coordinator.engine.runner import run_coordinator
from coordinator.store.database import Store
from protocol.contract.messages import ErrorReply, Reply, Task
from protocol.contract.payloads import PrototypeSet
from protocol.transport.paho import MqttTransport

pytestmark = pytest.mark.network

FED = "unverified"
DIM = 16
AGENTS = ["agent0", "agent1", "agent2"]

Targeted = Callable[[str, Task], bool]  # (device, task): does the forger answer it first?
Attack = Callable[[Forger, str, Task], None]


class Gates:
    """An honest device's reply to a targeted task waits until the forger is done with it."""

    def __init__(self) -> None:
        self._events: defaultdict[str, threading.Event] = defaultdict(threading.Event)
        self._lock = threading.Lock()

    def _event(self, task_id: str) -> threading.Event:
        with self._lock:
            return self._events[task_id]

    def wait(self, task_id: str) -> None:
        assert self._event(task_id).wait(60), f"the forger never finished with {task_id}"

    def open(self, task_id: str) -> None:
        self._event(task_id).set()


@dataclass
class Outcome:
    result: RunResult | None
    error: BaseException | None
    records: list[dict[str, Any]]
    run_dir: Path
    forger: Forger
    logs: list[logging.LogRecord] = field(default_factory=list)

    def global_protos(self) -> PrototypeSet:
        store = Store(self.run_dir / "state.sqlite")
        try:
            protos = store.global_state()["protos"]
        finally:
            store.close()
        assert isinstance(protos, PrototypeSet)
        return protos


def run_attack(
    port: int,
    tmp_path: Path,
    targeted: Targeted,
    attack: Attack,
    caplog: pytest.LogCaptureFixture,
    *,
    before_rounds: Callable[[Forger], None] | None = None,
    **run: Any,
) -> Outcome:
    """A FedProto run of ``AGENTS`` with a forger that ``attack``s each ``targeted`` task
    before its device answers; ``before_rounds`` runs once the devices are admitted and
    before any of them answers its first task."""
    gates, started = Gates(), threading.Event()

    def honest(device: str) -> Callable[[Task], Reply]:
        def answer(task: Task) -> Reply:
            assert started.wait(60), "the forger never got ready"
            if targeted(device, task):
                gates.wait(task.task_id)
            return proto_reply(task, prototypes(DIM))

        return answer

    def forge(forger: Forger, device: str, task: Task) -> None:
        if targeted(device, task):
            attack(forger, device, task)
            gates.open(task.task_id)

    forger = Forger(port, FED, forge)
    agents = [ScriptedAgent(port, FED, d, honest(d), feature_dim=DIM) for d in AGENTS]
    settings: dict[str, Any] = {
        "algorithm": "fedproto",
        "rounds": 2,
        "min_agents": len(AGENTS),
        "deadline_s": 60.0,
        "grace_s": 0.5,
        "max_retries": 2,
        **run,
    }
    run_dir = tmp_path / "run"
    cfg = load_config(None, [], run_dir=str(run_dir), run_id="unv", federation=FED, **settings)
    coord_t = MqttTransport(client_id=unique_id("coord"), port=port)
    box: dict[str, Any] = {}

    def coordinate() -> None:
        try:
            box["result"] = run_coordinator(cfg, coord_t)
        except BaseException as exc:  # the test reports it
            box["error"] = exc

    coord = threading.Thread(target=coordinate)
    caplog.set_level(logging.INFO)
    try:
        coord.start()
        assert wait_for(lambda: coord_t.connected, 30)
        forger.start()
        for agent in agents:
            agent.start()
        if before_rounds is not None:
            # round 1 is open (its tasks are out): the run has admitted the devices
            assert wait_for(lambda: len(forger.tasks) >= len(AGENTS), 60), "no round 1"
            before_rounds(forger)
        started.set()
        coord.join(180)
        assert not coord.is_alive(), "the run never ended"
    finally:
        started.set()
        coord_t.close()
        forger.close()
        for agent in agents:
            agent.close()
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    records = [json.loads(line) for line in lines if line]
    return Outcome(
        box.get("result"), box.get("error"), records, run_dir, forger, list(caplog.records)
    )


def assert_every_device_counted(outcome: Outcome) -> None:
    """The run finished, and every step took every honest device's reply."""
    assert outcome.error is None, f"the run stopped: {outcome.error!r}"
    assert [r.get("status", "done") for r in outcome.records] == ["done"] * 3
    for record in outcome.records:
        assert sorted(record["agents"]) == AGENTS, record["failed"]
        assert record["failed"] == {}


def round_1_of(device: str) -> Targeted:
    return lambda d, task: d == device and task.round == 1 and task.phase == "train"


def test_a_forged_first_reply_of_another_dimension_fixes_nothing(
    mosquitto: MosquittoBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: no feature_dim declared; the forger answers agent0's round-1 task in 7-d before
    # any device has answered round 1
    refusals, judged = [], threading.Event()

    def seven_dimensions(forger: Forger, device: str, task: Task) -> None:
        if device != "agent0":
            assert judged.wait(60), "the forgery was never judged"
            return
        msg_id = forger.send(device, "reply", proto_reply(task, prototypes(7)), task.round)
        refusals.append(forger.wait_ack(msg_id))
        judged.set()

    def round_1(device: str, task: Task) -> bool:
        return task.round == 1 and task.phase == "train"

    # Execute
    outcome = run_attack(mosquitto.port, tmp_path, round_1, seven_dimensions, caplog)

    # Assert: refused against the fleet's registered dimension; the honest replies all count
    assert len(refusals) == 1 and refusals[0] is not None and not refusals[0].accepted
    assert "dimension 16" in refusals[0].reason, refusals[0].reason
    assert_every_device_counted(outcome)
    assert outcome.global_protos().dim == DIM


def test_an_invalid_reply_in_a_devices_name_does_not_fail_that_device(
    mosquitto: MosquittoBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: the forger answers agent2's round-1 task first, with values beyond the bound
    refusals = []

    def huge_values(forger: Forger, device: str, task: Task) -> None:
        msg_id = forger.send(device, "reply", proto_reply(task, prototypes(DIM, 1e30)), 1)
        refusals.append(forger.wait_ack(msg_id))

    # Execute
    outcome = run_attack(mosquitto.port, tmp_path, round_1_of("agent2"), huge_values, caplog)

    # Assert: the forgery is refused, and agent2's own reply still counts in round 1
    assert len(refusals) == 1 and refusals[0] is not None and not refusals[0].accepted
    assert "|value| <= 10000" in refusals[0].reason
    assert_every_device_counted(outcome)
    assert np.abs(outcome.global_protos().vectors).max() < 100


def test_forged_errors_and_a_wrong_round_reply_cannot_fail_a_step(
    mosquitto: MosquittoBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: in round 2 the forger says every device's task failed, then replies for round 9
    refusals = []

    def error_then_wrong_round(forger: Forger, device: str, task: Task) -> None:
        error = ErrorReply(code="task_failed", reason="forged", task_id=task.task_id)
        forger.send(device, "error", error, task.round)
        msg_id = forger.send(device, "reply", proto_reply(task, prototypes(DIM), round=9), 9)
        refusals.append(forger.wait_ack(msg_id))  # one client, in order: the error came first

    def round_2(device: str, task: Task) -> bool:
        return task.round == 2 and task.phase == "train"

    # Execute
    outcome = run_attack(mosquitto.port, tmp_path, round_2, error_then_wrong_round, caplog)

    # Assert: every forgery was judged (and the wrong round refused); round 2 took all three
    assert len(refusals) == len(AGENTS)
    assert all(a is not None and not a.accepted and "round" in a.reason for a in refusals)
    assert_every_device_counted(outcome)
    reported = [r.getMessage() for r in outcome.logs if "reported task_failed" in r.getMessage()]
    assert len(reported) == len(AGENTS)  # recorded, not acted on


def flood_registrations(count: int) -> Callable[[Forger], None]:
    """``count`` forged registrations, then one frame whose refusal proves them handled."""

    def flood(forger: Forger) -> None:
        for i in range(count):
            forger.send(f"sybil{i}", "register", fedproto_register(f"sybil{i}", DIM))
        # handled in order after the flood: its ack (a refusal: no open task) closes it
        probe = Reply(task_id="none", round=1, phase="train", num_samples=1)
        assert forger.wait_ack(forger.send("sybil0", "reply", probe, 1)) is not None

    return flood


@pytest.mark.parametrize(
    ("limit", "reason"),
    [
        ({"max_agents": 3}, "at most 3 agents"),
        ({"max_registrations_per_min": 3}, "new devices a minute"),
    ],
    ids=["max-agents", "rate"],
)
def test_a_flood_of_forged_registrations_cannot_take_the_quorum(
    mosquitto: MosquittoBroker,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    limit: dict[str, int],
    reason: str,
) -> None:
    # Prepare: once the three devices are admitted, 1,000 forged devices register
    def nothing(forger: Forger, device: str, task: Task) -> None:
        """No forged replies: the sybils simply never answer."""

    # Execute
    outcome = run_attack(
        mosquitto.port,
        tmp_path,
        lambda d, task: False,
        nothing,
        caplog,
        before_rounds=flood_registrations(1000),
        deadline_s=3.0,
        **limit,
    )

    # Assert: the flood is refused and said so in a bounded number of lines; no step selected
    # a sybil
    assert_every_device_counted(outcome)
    assert all(r["participants"] == AGENTS for r in outcome.records)
    assert outcome.result is not None
    rejected = outcome.result.rejected
    assert rejected.get("refused_agent", 0) + rejected.get("rate_limited", 0) >= 990, rejected
    lines = [r.getMessage() for r in outcome.logs if r.levelno >= logging.WARNING]
    refusals = [line for line in lines if reason in line]
    assert 1 <= len(refusals) <= 20, len(refusals)
    assert any("refused" in line and "in the last" in line for line in lines), lines[-5:]


def test_a_junk_flood_is_counted_apart_and_logged_in_summary(
    mosquitto: MosquittoBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: during round 1, 2,000 undecodable 1 KiB frames on agent0's reply topic
    junk, count = b"\xc1" * 1024, 2000

    def flood(forger: Forger, device: str, task: Task) -> None:
        topic = forger.topics.up(device, "reply")
        for _ in range(count):
            forger.publish(topic, junk)
        probe = Reply(task_id="none", round=1, phase="train", num_samples=1)
        assert forger.wait_ack(forger.send(device, "reply", probe, 1)) is not None

    # Execute
    outcome = run_attack(mosquitto.port, tmp_path, round_1_of("agent0"), flood, caplog)

    # Assert: the junk is in round 1's refused bytes, not in its traffic; a few log lines
    assert_every_device_counted(outcome)
    first = outcome.records[0]
    assert first["bytes_refused"]["rx.invalid"] == count * len(junk)
    assert "rx.invalid" not in first["bytes"]
    assert first["bytes_total"] == sum(first["bytes"].values()) < count * len(junk)
    lines = [r.getMessage() for r in outcome.logs if "rejected a frame" in r.getMessage()]
    assert 1 <= len(lines) <= 20, len(lines)
    summaries = [r.getMessage() for r in outcome.logs if "in the last" in r.getMessage()]
    assert any("frames" in line for line in summaries), summaries
