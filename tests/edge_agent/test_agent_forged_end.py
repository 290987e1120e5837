"""A run's end that cannot be forged into a success, over real Mosquitto without signing.

Any client of an anonymous broker can publish a retained ``finished`` as the coordinator. An
agent exits 0 only for a run it completed: it answered the run's final task, and the state
says the last round. A forged ``finished`` mid-run ends it non-zero with what it saw, and a
restarted agent that finds it retained says so and exits non-zero instead of waiting forever.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from edge_agent.cli import EXIT_GAVE_UP, EXIT_UNCONFIRMED, main
from edge_agent.run_end import judge_end
from protocol.contract.codec import Envelope, encode
from protocol.contract.messages import Register, Reply
from protocol.transport.paho import MqttTransport
from tests.edge_agent.test_agent_lifecycle import T, agent_argv, state
from tests.edge_agent.test_agent_stop import Recorder
from tests.helpers_runtime import clean_env


def forge(port: int, kind: str, round_: int) -> None:
    """An anonymous client publishes a retained coordinator state of run r1, unsigned."""
    forger = MqttTransport(client_id="forger", port=port, clean_session=True)
    forger.connect()
    try:
        frame = encode(Envelope(body=state(kind, "r1", round_), sender="coordinator"))
        forger.publish(T.coord_state, frame, qos=1, retain=True)
    finally:
        forger.close()


def run_agent(port: int, tmp_path: Path, script: Callable[[], None]) -> int:
    """``edge-agent`` (``main``, in this process) while ``script`` plays the run's other side."""
    failures: list[BaseException] = []

    def play() -> None:
        try:
            script()
        except BaseException as exc:  # reported by the test, not lost in the thread
            failures.append(exc)

    thread = threading.Thread(target=play, daemon=True)
    thread.start()
    code = main(agent_argv(port, tmp_path, "--algorithm", "fedproto"))
    thread.join(timeout=60)
    assert not failures, failures
    return code


@pytest.mark.network
def test_a_forged_finished_mid_run_is_no_success_and_stops_a_restart_at_once(
    mosquitto, tmp_path: Path
) -> None:
    # Prepare: run r1 of 3 rounds; the agent answers round 1
    coord = Recorder(mosquitto.port)
    coord.publish(state("running", "r1", 1))

    def round_one_then_forgery() -> None:
        coord.next(Register)
        coord.task("r1.1.dev1", 1, local_epochs=1)
        coord.next(Reply, "r1.1.dev1")
        forge(mosquitto.port, "finished", 3)  # "round 3 of 3": a complete run, allegedly

    # Execute: the forged end reaches the running agent, then a restarted one (retained)
    try:
        code = run_agent(mosquitto.port, tmp_path, round_one_then_forgery)
        restart = subprocess.run(
            [sys.executable, "-m", "edge_agent.cli", *agent_argv(mosquitto.port, tmp_path)],
            check=False,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=240,  # it used to wait for a new run forever
        )
    finally:
        coord.transport.close()
    # Assert: neither exits 0; the restart names what it saw
    assert code == EXIT_UNCONFIRMED
    assert restart.returncode == EXIT_UNCONFIRMED, restart.stderr
    assert "run r1 is announced finished (round 3 of 3)" in restart.stderr
    assert "has not done its final phase" in restart.stderr and "unsigned" in restart.stderr


@pytest.mark.network
def test_a_forged_early_finished_is_reported_as_given_up(mosquitto, tmp_path: Path) -> None:
    # Prepare
    coord = Recorder(mosquitto.port)
    coord.publish(state("running", "r1", 1))

    def forgery_at_round_two() -> None:
        coord.next(Register)
        forge(mosquitto.port, "finished", 2)

    # Execute
    try:
        code = run_agent(mosquitto.port, tmp_path, forgery_at_round_two)
    finally:
        coord.transport.close()
    # Assert
    assert code == EXIT_GAVE_UP


@pytest.mark.network
def test_the_end_of_a_run_whose_final_phase_the_agent_did_exits_0(
    mosquitto, tmp_path: Path
) -> None:
    # Prepare: round 1, then the final phase, then the coordinator's own "finished"
    coord = Recorder(mosquitto.port)
    coord.publish(state("running", "r1", 1))

    def whole_run() -> None:
        coord.next(Register)
        coord.task("r1.1.dev1", 1, local_epochs=1)
        coord.next(Reply, "r1.1.dev1")
        coord.task("r1.4.dev1", 4, phase="final")
        coord.next(Reply, "r1.4.dev1")
        coord.publish(state("finished", "r1", 3))

    # Execute
    try:
        code = run_agent(mosquitto.port, tmp_path, whole_run)
    finally:
        coord.transport.close()
    # Assert
    assert code == 0


def test_the_judgement_of_a_finished_state() -> None:
    end = state("finished", "r1", 3)
    assert judge_end(end, did_final=True, verified=True).kind == "completed"
    assert judge_end(end, did_final=True, verified=False).kind == "completed"
    assert judge_end(end, did_final=False, verified=True).kind == "unconfirmed"
    # a coordinator that gives up in a final step announces that step's round (rounds + 1)
    assert judge_end(state("finished", "r1", 4), did_final=True, verified=True).kind == "gave_up"
    assert "unsigned" not in judge_end(end, did_final=False, verified=True).message
