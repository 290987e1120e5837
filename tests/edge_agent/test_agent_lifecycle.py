"""An agent's life across runs: told when refused or given up on, exit codes,
adopting the run's algorithm, a daemon that takes part in the next run."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from edge_agent.cli import EXIT_GAVE_UP, EXIT_REFUSED, main
from protocol.contract.codec import Envelope
from protocol.contract.messages import REFUSED, CoordinatorState, ErrorReply, Register
from protocol.contract.topics import Topics
from protocol.transport.base import MemoryBroker
from protocol.transport.endpoint import Endpoint
from protocol.transport.paho import MqttTransport
from tests.edge_agent.test_agent import make

T = Topics()


def state(kind: str, run_id: str, round_: int = 0, algorithm: str = "fedproto"):
    return CoordinatorState(
        state=kind, run_id=run_id, algorithm=algorithm, round=round_, total_rounds=3
    )


def test_only_the_end_of_a_run_the_agent_joined_ends_it(tmp_path: Path) -> None:
    agent = make(tmp_path, MemoryBroker())
    # a retained "finished" of an earlier run: an agent that arrives for the next one waits
    agent.on_coordinator_state(state("finished", "old", 3))
    assert not agent.finished.is_set()
    agent.on_coordinator_state(state("running", "r1", 1))
    agent.finals_done.add("r1")  # as answering r1's final task does
    agent.on_coordinator_state(state("finished", "r1", 3))
    assert agent.finished.is_set() and agent.end is not None and agent.end.kind == "completed"


def test_a_run_that_ends_early_is_reported_as_given_up(tmp_path: Path) -> None:
    agent = make(tmp_path, MemoryBroker())
    agent.on_coordinator_state(state("starting", "r1"))
    agent.on_coordinator_state(state("finished", "r1", 1))  # the coordinator gave up
    assert agent.finished.is_set() and agent.end is not None and agent.end.kind == "gave_up"
    assert agent.gave_up is not None and agent.gave_up.startswith("run r1 ended at round 1 of 3")


class FakeCoordinator:
    """Publishes retained states, records registrations, refuses or finishes runs on cue."""

    def __init__(self, port: int) -> None:
        self.transport = MqttTransport(client_id="fake-coord", port=port, clean_session=True)
        self.endpoint = Endpoint(self.transport, sender="coordinator")
        self.registered: list[Register] = []
        # an action per algorithm, run on its first registration (an agent registers on connect
        # and again on each coordinator state it hears)
        self.on_register: dict = {}
        self.endpoint.subscribe(f"{T.base}/dev/+/up/register", self._register)
        self.transport.connect()

    def publish(self, body: CoordinatorState) -> None:
        self.endpoint.send(T.coord_state, body, retain=True)

    def refuse(self, reg: Register) -> None:
        err = ErrorReply(code=REFUSED, reason="it has 10 classes; this run has 7")
        self.endpoint.send(T.down(reg.device_id, "error"), err)

    def _register(self, env: Envelope, _topic: str) -> None:
        assert isinstance(env.body, Register)
        self.registered.append(env.body)
        action = self.on_register.pop(env.body.algorithm, None)
        if action is not None:
            action(env.body)


def agent_argv(port: int, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--broker",
        f"127.0.0.1:{port}",
        "--id",
        "dev1",
        "--model",
        "mlp_s",
        "--feature-dim",
        "16",
        "--device",
        "cpu",
        "--state-dir",
        str(tmp_path / "dev1"),
        "--no-export",
        *extra,
    ]


@pytest.mark.network
def test_an_unpinned_agent_adopts_the_runs_algorithm_and_a_refusal_exits_non_zero(
    mosquitto, tmp_path: Path
) -> None:
    coord = FakeCoordinator(mosquitto.port)
    coord.publish(state("running", "r1", 1, algorithm="local"))
    coord.on_register = {"local": coord.refuse}
    try:
        code = main(agent_argv(mosquitto.port, tmp_path))
    finally:
        coord.transport.close()
    assert code == EXIT_REFUSED
    assert {r.algorithm for r in coord.registered} == {"local"}


@pytest.mark.network
def test_an_agent_exits_non_zero_when_the_coordinator_gives_up(mosquitto, tmp_path: Path) -> None:
    coord = FakeCoordinator(mosquitto.port)
    coord.publish(state("running", "r1", 1))
    coord.on_register = {"fedproto": lambda _reg: coord.publish(state("finished", "r1", 1))}
    try:
        code = main(agent_argv(mosquitto.port, tmp_path, "--algorithm", "fedproto"))
    finally:
        coord.transport.close()
    assert code == EXIT_GAVE_UP


@pytest.mark.network
def test_a_daemon_takes_part_in_the_next_run(mosquitto, tmp_path: Path) -> None:
    # Prepare: run r1 finishes after the agent registered; run r2 starts; r2 refuses it (to end)
    coord = FakeCoordinator(mosquitto.port)
    coord.publish(state("starting", "r1"))
    second = threading.Event()

    def finish_r1(_reg: Register) -> None:
        coord.publish(state("finished", "r1", 3))
        coord.publish(state("starting", "r2", algorithm="local"))
        second.set()

    coord.on_register = {"fedproto": finish_r1, "local": coord.refuse}
    # Execute
    try:
        code = main(agent_argv(mosquitto.port, tmp_path, "--daemon"))
    finally:
        coord.transport.close()
    # Assert: registered for r1 (fedproto), then, a fresh agent, for r2 (local); r1 archived
    assert second.is_set() and code == EXIT_REFUSED
    algorithms = [r.algorithm for r in coord.registered]
    assert algorithms[0] == "fedproto" and algorithms[-1] == "local"
    assert (tmp_path / "dev1" / "runs" / "r1").is_dir()


def test_the_agent_logs_its_data_and_each_rounds_accuracy_and_loss(tmp_path: Path, caplog) -> None:
    from tests.edge_agent.test_agent import task

    caplog.set_level("INFO", logger="edgefl")
    agent = make(tmp_path, MemoryBroker())
    agent.on_task(task(), Envelope(body=task(), sender="coordinator"))
    text = caplog.text
    assert "data digits: dirichlet:1 shard 0 of 3; 10 classes, input 1x8x8; train " in text
    assert "train per class: 0 " in text
    assert "round 1 train: acc_local " in text and "loss_local " in text


@pytest.mark.network
def test_an_agent_without_classes_registers_the_classes_its_coordinator_names(
    mosquitto, tmp_path: Path
) -> None:
    # Prepare: the run numbers the digits backwards; the agent is pinned but names no classes
    names = [str(i) for i in range(9, -1, -1)]
    coord = FakeCoordinator(mosquitto.port)
    coord.publish(
        CoordinatorState(
            state="running",
            run_id="r1",
            algorithm="fedproto",
            round=1,
            total_rounds=3,
            classes=names,
        )
    )
    coord.on_register = {"fedproto": coord.refuse}  # ends the agent once it has registered
    # Execute
    try:
        code = main(agent_argv(mosquitto.port, tmp_path, "--algorithm", "fedproto"))
    finally:
        coord.transport.close()
    # Assert: its labels were mapped by name, so its class 0 is the run's '9'
    assert code == EXIT_REFUSED
    assert coord.registered and coord.registered[-1].class_names == names
