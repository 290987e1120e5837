"""Shared-subscription ingest workers over a real Mosquitto: two ``coordinator
ingest-worker`` processes take a real run's replies; every reply is stored once and
acknowledged, the run completes with the metrics of a run without workers, and a worker killed
with SIGKILL while it holds replies loses none of them."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from coordinator.broker.embedded import MosquittoBroker, free_port
from coordinator.config import RunConfig
from coordinator.engine.ingest_worker import spawned_workers, worker_argv
from coordinator.sim.simulate import simulate
from protocol.transport.address import BrokerAddress, parse_broker
from protocol.transport.base import Transport, Will
from protocol.transport.paho import MqttTransport
from tests.conftest import mosquitto_websockets_error
from tests.helpers_runtime import FLEET, clean_env, run_config, stored_rows, worker_counts

pytestmark = [pytest.mark.network, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
AGENTS = ["agent0", "agent1", "agent2"]
# what follows the clock, not the seed; and the byte totals (compared kind by kind below)
CLOCK_KEYS = frozenset(
    {"samples_per_s", "train_s", "duration_s", "time", "bytes_progress", "reply_s"}
)
BYTE_KEYS = frozenset({"bytes", "bytes_total"})


def config(tmp_path: Path, name: str, **run: Any) -> RunConfig:
    return run_config(
        tmp_path, "fedproto", rounds=2, seed=3, run_id=name, federation=name, **run
    ).replace(run_dir=str(tmp_path / name))


def over(port: int) -> Any:
    def factory(client_id: str, will: Will) -> Transport:
        return MqttTransport(client_id=f"edgefl-{client_id}", port=port, will=will)

    return factory


def start_worker(
    cfg: RunConfig, port: int, worker: str, log: Path, stall: Path | None = None
) -> subprocess.Popen[bytes]:
    """A ``coordinator ingest-worker`` process (with ``stall``: one that hangs holding replies)."""
    argv = worker_argv(cfg, BrokerAddress("127.0.0.1", port), worker, ["--log-level", "INFO"])
    if stall is not None:  # the same command line through the stalling wrapper
        argv[1:3] = ["-m", "tests.coordinator.engine.stalling_worker", str(stall)]
    with log.open("wb") as out:
        return subprocess.Popen(
            argv, env=clean_env(PYTHONPATH=str(ROOT)), stdout=out, stderr=subprocess.STDOUT
        )


class SmallFrames(MqttTransport):
    """An agent's client whose broker takes packets of at most 2 KiB: its replies go chunked."""

    @property  # type: ignore[override]
    def max_packet_size(self) -> int | None:
        return 2048

    @max_packet_size.setter
    def max_packet_size(self, _value: int | None) -> None:
        pass


def unacknowledged(cfg: RunConfig) -> list[Path]:
    return sorted((Path(cfg.run_dir) / "agents").glob("*/outbox/*.msg"))


def seeded(value: Any, drop: frozenset[str]) -> Any:
    """The metrics without ``drop``: what two runs of one seed must agree on."""
    if isinstance(value, dict):
        return {k: seeded(v, drop) for k, v in value.items() if k not in drop}
    if isinstance(value, list):
        return [seeded(v, drop) for v in value]
    return value


def test_two_workers_store_every_reply_once_and_give_the_runs_metrics(
    mosquitto, tmp_path: Path
) -> None:
    # Prepare
    cfg = config(tmp_path, "ingw", ingest_workers=2)
    logs = [tmp_path / "w1.log", tmp_path / "w2.log"]
    workers = [start_worker(cfg, mosquitto.port, f"w{i + 1}", logs[i]) for i in range(2)]

    # Execute
    try:
        result = simulate(cfg, FLEET, transport_factory=over(mosquitto.port))
        codes = [w.wait(timeout=60) for w in workers]  # they leave when the run finishes
    finally:
        for w in workers:
            w.kill()
    plain = simulate(config(tmp_path, "inpr"), FLEET, transport_factory=over(mosquitto.port))

    # Assert: each step's reply of each agent stored once, none left unacknowledged
    assert codes == [0, 0], [log.read_text() for log in logs]
    rows = stored_rows(cfg.run_dir)
    assert [(s, d) for s, d, _ in rows] == [(s, a) for s in range(3) for a in AGENTS]
    assert len({m for _, _, m in rows}) == len(rows)
    assert unacknowledged(cfg) == []
    # the broker shared them out; every stored reply was stored by exactly one worker
    counts = [worker_counts(log) for log in logs]
    assert all(c.get("stored", 0) > 0 for c in counts), counts
    assert sum(c["stored"] for c in counts) == len(rows)
    # the leader took none of them itself and aggregated all of them
    assert all(sorted(m["agents"]) == AGENTS for m in result.metrics)
    # the workers' reply and ack bytes are in the leader's step records, as the leader's own
    # are in a run without workers (same seed, same run-id length: the same frame sizes)
    moved = [{k: m["bytes"].get(k) for k in ("rx.reply", "tx.ack")} for m in result.metrics]
    assert moved == [{k: m["bytes"].get(k) for k in ("rx.reply", "tx.ack")} for m in plain.metrics]
    assert all(m["rx.reply"] and m["tx.ack"] for m in moved), moved
    assert seeded(result.metrics, CLOCK_KEYS | BYTE_KEYS) == seeded(
        plain.metrics, CLOCK_KEYS | BYTE_KEYS
    )


def test_a_worker_killed_holding_replies_loses_none_and_stores_none_twice(
    mosquitto, tmp_path: Path
) -> None:
    # Prepare: w2 takes its share of the replies and hangs before storing them
    cfg = config(tmp_path, "ingk", ingest_workers=2)
    holding = tmp_path / "w2.holding"
    good = start_worker(cfg, mosquitto.port, "w1", tmp_path / "w1.log")
    stuck = start_worker(cfg, mosquitto.port, "w2", tmp_path / "w2.log", stall=holding)

    def kill_when_holding() -> None:
        end = time.monotonic() + 240
        while not holding.exists() and stuck.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        os.kill(stuck.pid, signal.SIGKILL)  # mid-round: its replies neither stored nor acked

    killer = threading.Thread(target=kill_when_holding, daemon=True)
    killer.start()

    # Execute
    try:
        result = simulate(cfg, FLEET, transport_factory=over(mosquitto.port))
        code = good.wait(timeout=60)
    finally:
        good.kill()
        stuck.kill()
    killer.join(timeout=10)

    # Assert: it was killed holding replies, and every step still has every agent's reply,
    # stored once (by the survivor), acknowledged, and aggregated
    assert holding.exists() and stuck.wait(timeout=10) == -signal.SIGKILL
    assert code == 0
    rows = stored_rows(cfg.run_dir)
    assert [(s, d) for s, d, _ in rows] == [(s, a) for s in range(3) for a in AGENTS]
    assert len({m for _, _, m in rows}) == len(rows)
    assert unacknowledged(cfg) == []
    assert worker_counts(tmp_path / "w1.log")["stored"] == len(rows)
    assert all(sorted(m["agents"]) == AGENTS and not m["failed"] for m in result.metrics)


def test_spawned_workers_take_the_replies_and_leave_with_the_run(mosquitto, tmp_path: Path) -> None:
    # `coordinator serve --spawn-workers`: the leader starts its workers and they end with it
    cfg = config(tmp_path, "ings", ingest_workers=2)
    with spawned_workers(
        cfg, BrokerAddress("127.0.0.1", mosquitto.port), ["--log-level", "INFO"]
    ) as workers:
        result = simulate(cfg, FLEET, transport_factory=over(mosquitto.port))
    assert [w.returncode for w in workers] == [0, 0]  # left by themselves: the run finished
    logs = sorted((Path(cfg.run_dir) / "ingest").glob("w*.log"))
    assert [log.name for log in logs] == ["w1.log", "w2.log"]
    rows = stored_rows(cfg.run_dir)
    assert len(rows) == 3 * len(AGENTS) and unacknowledged(cfg) == []
    assert sum(worker_counts(log)["stored"] for log in logs) == len(rows)
    assert all(sorted(m["agents"]) == AGENTS for m in result.metrics)


def test_spawned_workers_take_the_replies_over_websockets(tmp_path: Path) -> None:
    # the workers reach the broker through its WebSockets listener (ws://), the run over TCP
    if mosquitto_websockets_error():
        pytest.skip(f"mosquitto without WebSockets: {mosquitto_websockets_error()}")
    ws_port = free_port()
    websockets = f"listener {ws_port} 127.0.0.1\nprotocol websockets\n"
    cfg = config(tmp_path, "ingw", ingest_workers=1)
    with MosquittoBroker(extra_config=websockets) as broker:
        url = parse_broker(f"ws://127.0.0.1:{ws_port}/mqtt")
        with spawned_workers(cfg, url, ["--log-level", "INFO"]) as workers:
            result = simulate(cfg, FLEET, transport_factory=over(broker.port))
    assert [w.returncode for w in workers] == [0]
    log = Path(cfg.run_dir) / "ingest" / "w1.log"
    assert f"connected to {url}" in log.read_text()
    assert worker_counts(log)["stored"] == len(stored_rows(cfg.run_dir)) == 3 * len(AGENTS)
    assert unacknowledged(cfg) == []
    assert all(sorted(m["agents"]) == AGENTS for m in result.metrics)


def test_chunked_replies_reach_the_leader_through_the_workers(mosquitto, tmp_path: Path) -> None:
    # Prepare: 128-float prototypes per class make each training reply ~5 KB, sent in chunks of
    # at most 2 KiB, which the broker shares out among the workers like whole replies
    cfg = config(tmp_path, "ingc", ingest_workers=2, deadline_s=30.0)
    logs = [tmp_path / "w1.log", tmp_path / "w2.log"]
    workers = [start_worker(cfg, mosquitto.port, f"w{i + 1}", logs[i]) for i in range(2)]

    def factory(client_id: str, will: Will) -> Transport:
        cls = MqttTransport if client_id == "coordinator" else SmallFrames
        return cls(client_id=f"edgefl-{client_id}", port=mosquitto.port, will=will)

    # Execute
    try:
        result = simulate(cfg, replace(FLEET, feature_dim=128), transport_factory=factory)
        codes = [w.wait(timeout=60) for w in workers]
    finally:
        for w in workers:
            w.kill()

    # Assert: the chunked replies passed the workers by (their chunks travel on the chunk
    # topics, which the leader takes), and every step still has every agent's reply, stored
    # once, acknowledged and aggregated
    assert codes == [0, 0], [log.read_text() for log in logs]
    counts = [worker_counts(log) for log in logs]
    # the workers stored the final step's small replies; the leader the rounds' chunked ones
    assert sum(c.get("stored", 0) for c in counts) == len(AGENTS), counts
    rows = stored_rows(cfg.run_dir)
    assert [(s, d) for s, d, _ in rows] == [(s, a) for s in range(3) for a in AGENTS]
    assert unacknowledged(cfg) == []
    assert all(sorted(m["agents"]) == AGENTS and not m["failed"] for m in result.metrics)
    chunked = [m["bytes"].get("rx.reply", 0) for m in result.metrics[:2]]  # the two rounds
    assert all(n > 3 * 2048 for n in chunked), chunked  # counted once, by the leader
