"""kill -9 of a coordinator in buffered mode, over a real Mosquitto: after its restart no
acknowledged reply is lost and none is folded twice, a task still in flight across the crash
included (its device answers the resent task with the reply it already computed)."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import wait_for
from helpers_mqtt import ScriptedAgent, proto_reply
from test_buffered_mqtt import DIM, FED, WAIT_S, protos

from coordinator.broker.embedded import MosquittoBroker
from protocol.contract.codec import Envelope
from protocol.contract.messages import CoordinatorState, Reply, Task

pytestmark = [pytest.mark.network, pytest.mark.slow]

BIN = Path(sys.executable).parent


class OnceAgent(ScriptedAgent):
    """Answers each task id once, as an edge agent does: the same task again gets the same
    reply envelope (same message id) again."""

    def __init__(self, port: int, device_id: str, gate: dict[int, threading.Event]) -> None:
        super().__init__(port, FED, device_id, self._script, feature_dim=DIM)
        self.gate = gate  # round -> released before this device answers that round
        self.replies: dict[str, Envelope] = {}
        self._lock = threading.Lock()

    def _on_message(self, env: Envelope, topic: str) -> None:
        # as an edge agent: a coordinator that went (its will) is joined again when it is back
        if isinstance(env.body, CoordinatorState) and env.body.state == "offline":
            self._runs.clear()
        super()._on_message(env, topic)

    def _script(self, task: Task) -> Reply | None:
        if task.phase != "train":
            return proto_reply(task)
        event = self.gate.get(task.round)
        if event is not None:
            assert event.wait(4 * WAIT_S), f"{self.device_id}: round {task.round} never released"
        return proto_reply(task, protos(float(task.round)))

    def _reply(self, task: Task) -> None:
        with self._lock:
            env = self.replies.get(task.task_id)
        if env is None:
            reply = self.answer(task)
            if reply is None:
                return
            env = self.endpoint.envelope(reply, round=task.round)
            with self._lock:
                env = self.replies.setdefault(task.task_id, env)
        if env.msg_id not in self.sent:
            self.sent.append(env.msg_id)
        self.endpoint.send_envelope(self.topics.up(self.device_id, "reply"), env)


def serve(port: int, run_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    settings = [
        "run.min_agents=3",
        f"run.deadline_s={WAIT_S}",
        "run.run_id=bufkill",
        f"run.federation={FED}",
        "run.mode=buffered",
        "run.buffer_size=2",
        "run.max_staleness=3",
    ]
    cmd = [str(BIN / "coordinator"), "serve", "--broker", f"127.0.0.1:{port}"]
    cmd += ["--algorithm", "fedproto", "--rounds", "3", "--run-dir", str(run_dir)]  # 3: below
    for s in settings:
        cmd += ["--set", s]
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def stored(run_dir: Path) -> list[tuple[int, str, str]]:
    """(step, device, message id) of every stored reply, folded or not."""
    try:
        db = sqlite3.connect(f"file:{run_dir / 'state.sqlite'}?mode=ro", uri=True, timeout=5)
        rows = db.execute(
            "SELECT step, device_id, msg_id FROM updates UNION ALL "
            "SELECT step, device_id, msg_id FROM aggregated"
        ).fetchall()
        db.close()
        return sorted(rows)
    except sqlite3.Error:
        return []


def test_kill_9_in_buffered_mode_loses_no_reply_and_folds_none_twice(
    mosquitto: MosquittoBroker, tmp_path: Path
) -> None:
    # Prepare: round 1 folds a0 and a1; a2's round-1 task and a1's round-2 one wait for the
    # restart, so that the crash hits round 2 with a0's reply stored and two tasks in flight
    restarted = threading.Event()
    run_dir, log = tmp_path / "run", tmp_path / "coordinator.log"
    first = serve(mosquitto.port, run_dir, log)
    agents = [
        OnceAgent(mosquitto.port, "a0", {}),
        OnceAgent(mosquitto.port, "a1", {2: restarted}),
        OnceAgent(mosquitto.port, "a2", {1: restarted}),
    ]
    try:
        for a in agents:
            a.start()
        # Execute: kill -9 once round 2 (step index 1) holds a stored reply
        assert wait_for(lambda: any(s == 1 for s, _, _ in stored(run_dir)), 4 * WAIT_S), (
            log.read_text()
        )
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        before = stored(run_dir)
        second = serve(mosquitto.port, run_dir, log)
        restarted.set()
        assert second.wait(timeout=6 * WAIT_S) == 0, log.read_text()
    finally:
        for a in agents:
            a.close()
        for p in (first, locals().get("second")):
            if isinstance(p, subprocess.Popen) and p.poll() is None:
                p.kill()
    # Assert: what was stored before the crash is still there, in the same step
    after = stored(run_dir)
    assert set(before) <= set(after)
    # no reply stored twice: one row per message id, in one step
    ids = [m for _, _, m in after]
    assert len(ids) == len(set(ids))
    # every reply a device computed was stored (none lost), but for one to the last training
    # round still in flight when that round's step closed: training is over by the time it
    # comes, and it is refused as late, as a late reply is in sync mode (docs/howto/stragglers.md)
    sent = {env.msg_id: env for a in agents for env in a.replies.values()}
    lost = set(sent) - set(ids)
    assert all(sent[m].round == 3 for m in lost), (lost, log.read_text())
    assert all(f"reply {sent[m].body.task_id} " in log.read_text() for m in lost)
    db = sqlite3.connect(run_dir / "state.sqlite")
    steps = db.execute("SELECT idx, status FROM steps ORDER BY idx").fetchall()
    records = [json.loads(r[0]) for r in db.execute("SELECT record FROM metrics ORDER BY step")]
    db.close()
    assert steps == [(0, "done"), (1, "done"), (2, "done"), (3, "done")]
    # ... and folded exactly once: a2's round-1 reply, across the crash, with its staleness
    folded = [(r["round"], d, s) for r in records[:3] for d, s in r["staleness"].items()]
    assert sum(1 for _, d, s in folded if d == "a2" and s >= 1) == 1, folded
    assert len(folded) == len({(d, r - s) for r, d, s in folded})  # one fold a task
