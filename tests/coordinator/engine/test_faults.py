"""Faults against a real Mosquitto with real ``edge-agent`` processes (issue: runtime §6).

Each test costs real processes (~1 GB and a few seconds of start-up each), so there are few.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from coordinator.config import load_config
from coordinator.engine.core import RunResult
from coordinator.engine.runner import coordinator_will, run_coordinator
from protocol.transport.paho import MqttTransport

pytestmark = [pytest.mark.network, pytest.mark.slow]

BIN = Path(sys.executable).parent
# agent2 is deliberately slow (a small ResNet, ~10 s a round here) so that it can be killed
# mid-training deterministically while the MLPs finish their rounds in well under a second
MODELS = ("mlp_s", "mlp_m", "resnet8")


def agent_cmd(port: int, i: int, tmp: Path, epochs_hint: str = "") -> list[str]:
    return [
        str(BIN / "edge-agent"),
        "--broker",
        f"127.0.0.1:{port}",
        "--id",
        f"agent{i}",
        "--algorithm",
        "fedproto",
        "--model",
        MODELS[i],
        "--feature-dim",
        "16",
        "--data",
        "digits",
        "--partition",
        "dirichlet:1.0",
        "--clients",
        "3",
        "--client-index",
        str(i),
        "--threads",
        "1",
        "--device",
        "cpu",
        "--state-dir",
        str(tmp / f"agent{i}"),
        "--no-export",
        "--log-level",
        "INFO",
    ]


class Fleet:
    """Agent processes with their logs."""

    def __init__(self, port: int, tmp: Path) -> None:
        self.port, self.tmp = port, tmp
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def log(self, i: int) -> Path:
        return self.tmp / f"agent{i}.log"

    def start(self, i: int) -> None:
        with self.log(i).open("ab") as out:
            self.procs[i] = subprocess.Popen(
                agent_cmd(self.port, i, self.tmp), stdout=out, stderr=subprocess.STDOUT
            )

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait(timeout=30)

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture
def fleet(mosquitto, tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(mosquitto.port, tmp_path)
    for i in range(3):
        f.start(i)
    yield f
    f.stop_all()


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def metric_lines(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def coordinator_thread(port: int, run_dir: Path, **run: object) -> tuple[threading.Thread, dict]:
    overrides = [f"hyper.{k}={v}" for k, v in {"local_epochs": 8, "lr": 0.05}.items()]
    cfg = load_config(
        None,
        overrides,
        algorithm="fedproto",
        run_dir=str(run_dir),
        min_agents=3,
        run_id="faults",
        **run,
    )
    box: dict = {}

    def target() -> None:
        transport = MqttTransport(
            client_id="edgefl-coordinator", port=port, will=coordinator_will(cfg)
        )
        try:
            box["result"] = run_coordinator(cfg, transport)
        except Exception as exc:  # surfaced by the test's assertion on box
            box["error"] = exc
        finally:
            transport.close()

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def test_agent_killed_mid_round_quorum_then_rejoins(
    mosquitto, fleet: Fleet, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    # rejoin_wait_s: round 3 waits for the restarted agent instead of racing its start-up;
    # deadline_s: the restarted agent's start-up and round took 41 s on a 2-core VM at load
    # 13 (beside a benchmark grid), past the 40 s this test had, so round 3 missed it there
    thread, box = coordinator_thread(
        mosquitto.port,
        run_dir,
        rounds=4,
        deadline_s=75.0,
        grace_s=1.0,
        min_replies=2,
        quorum_fraction=0.5,
        rejoin_wait_s=120.0,
    )
    # Execute: kill agent2 while it trains round 2
    wait_for(lambda: "round 2 phase train" in fleet.log(2).read_text(), 240, "agent2 in round 2")
    fleet.kill(2)
    wait_for(lambda: len(metric_lines(run_dir)) >= 2, 120, "round 2 to close")
    fleet.start(2)  # same state directory: resumes from its checkpoint
    thread.join(timeout=300)
    # Assert
    assert "error" not in box, box.get("error")
    result: RunResult = box["result"]
    rounds = {m["round"]: m for m in result.metrics}
    assert sorted(rounds[2]["agents"]) == ["agent0", "agent1"]
    assert rounds[2]["failed"] == {"agent2": "deadline"}
    assert all("agent2" in rounds[r]["agents"] for r in (3, 4, 5))  # it rejoined (5: final)
    assert "resumed from" in fleet.log(2).read_text()


def test_broker_restart_mid_run_completes(mosquitto, fleet: Fleet, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    thread, box = coordinator_thread(mosquitto.port, run_dir, rounds=3, deadline_s=60.0)
    wait_for(lambda: len(metric_lines(run_dir)) >= 1, 240, "round 1")
    mosquitto.stop()
    time.sleep(2.0)
    mosquitto.start()
    thread.join(timeout=400)
    assert "error" not in box, box.get("error")
    assert [m["round"] for m in box["result"].metrics] == [1, 2, 3, 4]
    assert all(len(m["agents"]) == 3 for m in box["result"].metrics)


def coordinator_cmd(port: int, run_dir: Path) -> list[str]:
    return [
        str(BIN / "coordinator"),
        "serve",
        "--broker",
        f"127.0.0.1:{port}",
        "--algorithm",
        "fedproto",
        "--rounds",
        "3",
        "--run-dir",
        str(run_dir),
        "--set",
        "run.min_agents=3",
        "--set",
        "run.deadline_s=90",
        "--set",
        "run.run_id=faults",
        "--set",
        "hyper.local_epochs=8",
    ]


def stored_updates(run_dir: Path, step: int) -> list[tuple[str, str]]:
    """The stored replies of ``step``: once it is done they have left ``updates`` for
    ``aggregated``."""
    try:
        db = sqlite3.connect(f"file:{run_dir / 'state.sqlite'}?mode=ro", uri=True, timeout=5)
        rows = db.execute(
            "SELECT device_id, msg_id FROM updates WHERE step=? UNION ALL "
            "SELECT device_id, msg_id FROM aggregated WHERE step=?",
            (step, step),
        ).fetchall()
        db.close()
        return sorted(rows)
    except sqlite3.Error:
        return []


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["kill", "ctrl-c"])
def test_coordinator_killed_mid_round_resumes_without_loss(
    mosquitto, fleet: Fleet, tmp_path: Path, sig: signal.Signals
) -> None:
    run_dir = tmp_path / "run"
    log_path = tmp_path / "coordinator.log"
    log = log_path.open("ab")
    first = subprocess.Popen(
        coordinator_cmd(mosquitto.port, run_dir), stdout=log, stderr=subprocess.STDOUT
    )
    # Execute: stop it once round 2 has at least one acknowledged (stored) update, while the
    # other agents' replies are in flight: the resumed coordinator must take them, not defer
    # them and then drop their resends as duplicates (the step would wait out its deadline)
    wait_for(lambda: len(stored_updates(run_dir, 1)) >= 1, 300, "a stored round-2 update")
    first.send_signal(sig)
    code = first.wait(timeout=30)
    if sig == signal.SIGINT:  # a clean stop: no traceback, how to resume
        text = log_path.read_text()
        assert code == 130 and "Traceback" not in text and "Resume with:" in text, text
    acked = stored_updates(run_dir, 1)
    second = subprocess.Popen(
        coordinator_cmd(mosquitto.port, run_dir), stdout=log, stderr=subprocess.STDOUT
    )
    assert second.wait(timeout=400) == 0
    # Assert: every step done once; the acknowledged updates were kept, none stored twice
    db = sqlite3.connect(run_dir / "state.sqlite")
    steps = db.execute("SELECT idx, status FROM steps ORDER BY idx").fetchall()
    assert steps == [(0, "done"), (1, "done"), (2, "done"), (3, "done")]
    after = stored_updates(run_dir, 1)
    assert set(acked) <= set(after) and len({d for d, _ in after}) == len(after) == 3
    metrics = [json.loads(r[0]) for r in db.execute("SELECT record FROM metrics ORDER BY step")]
    assert [m["round"] for m in metrics] == [1, 2, 3, 4]
    assert sorted(metrics[1]["agents"]) == ["agent0", "agent1", "agent2"]
    assert all(m["failed"] == {} for m in metrics)  # no reply lost to a deadline
