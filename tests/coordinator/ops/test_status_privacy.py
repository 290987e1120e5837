"""``coordinator status`` shows each device's privacy budget spent in a run with ``hyper.dp``."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from coordinator.ops.lifecycle import read_run
from coordinator.store.connection import SCHEMA
from protocol.contract.codec import Envelope, encode
from tests.helpers import fake_agent


def _run_dir(tmp_path: Path, hyper: dict[str, float], records: list[dict]) -> Path:
    db = sqlite3.connect(tmp_path / "state.sqlite")
    db.executescript(SCHEMA)
    config = {"run_id": "r", "algorithm": "fedproto", "hyper": hyper}
    db.execute("INSERT INTO meta VALUES ('config', ?)", (json.dumps(config),))
    for device in ("a0", "a1", "a2"):
        reg = fake_agent(device, "fedproto", {0: 1}).register
        blob = encode(Envelope(body=reg, sender=device))
        db.execute("INSERT INTO agents VALUES (?, ?, 1, 0.0)", (device, blob))
    for step, record in enumerate(records):
        db.execute("INSERT INTO metrics VALUES (?, ?)", (step, json.dumps(record)))
    db.commit()
    db.close()
    return tmp_path


def test_status_reads_each_devices_latest_epsilon(tmp_path: Path) -> None:
    records = [
        {"agents": {"a0": {"dp_epsilon": 1.0}, "a1": {"dp_epsilon": 1.0}}},
        {"agents": {"a0": {"dp_epsilon": 2.0}}},  # a1 not selected; a2 never replied
    ]
    run = read_run(_run_dir(tmp_path, {"dp_epsilon": 4.0}, records))
    assert run is not None
    assert {a.device_id: a.dp_epsilon for a in run.agents} == {"a0": 2.0, "a1": 1.0, "a2": None}


def test_a_run_without_dp_shows_no_epsilon(tmp_path: Path) -> None:
    records = [{"agents": {"a0": {"dp_epsilon": 1.0}}}]  # not a DP run: not read
    run = read_run(_run_dir(tmp_path, {"dp_epsilon": 0.0}, records))
    assert run is not None and all(a.dp_epsilon is None for a in run.agents)
