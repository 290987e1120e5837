"""The store with its replies' bytes in segments: a done step, once retired, keeps only its
message ids and its segments go (the store stays one step large), a quorum-failed one keeps
everything, a quarantined one keeps its bytes in SQLite, and a store written before segments
still reads."""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path

import pytest

from coordinator.engine.replies import ReplyDesk
from coordinator.store.database import AGGREGATED_STEPS, StepRecord, Store
from coordinator.store.segments import SEGMENTS_DIR
from coordinator.strategies import Step, create_strategy
from protocol.contract.codec import Envelope
from protocol.contract.messages import Ack, Reply
from tests.helpers_runtime import run_config

REPLY = bytes(range(256)) * 33  # ~8.4 KB: a FedProto reply


def open_step(store: Store, idx: int, devices: list[str]) -> None:
    store.open_step(StepRecord(idx, idx + 1, "train", devices, "open", 0))


def step_dirs(tmp_path: Path, store: Store) -> list[str]:
    store.segments.join()  # a sweep's files go on a thread of their own
    return sorted(p.name for p in (tmp_path / SEGMENTS_DIR).iterdir())


def test_reply_bytes_live_in_segments_and_only_their_place_in_sqlite(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    open_step(store, 0, ["a", "b"])

    with store.transaction():
        store.add_updates([(0, "a", "m1", "t1", REPLY), (0, "b", "m2", "t2", REPLY[::-1])])

    rows = store.db.execute("SELECT device_id, length(envelope), seg_length FROM updates")
    assert sorted(rows) == [("a", 0, len(REPLY)), ("b", 0, len(REPLY))]
    store.close()
    again = Store(tmp_path / "s.sqlite")  # a restarted coordinator reads them back
    assert again.updates(0) == [("a", "m1", REPLY), ("b", "m2", REPLY[::-1])]
    assert [(d, env) for _, d, env in again.stored_since(0, 0)] == [
        ("a", REPLY),
        ("b", REPLY[::-1]),
    ]
    assert step_dirs(tmp_path, store) == ["0"]


def test_a_done_step_keeps_its_message_ids_and_drops_its_rows_and_segments(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "s.sqlite")
    open_step(store, 0, ["a", "b"])
    store.add_updates([(0, "a", "m1", "t", REPLY), (0, "b", "m2", "t", REPLY)])
    store.add_updates([(1, "a", "early", "t", REPLY)])  # the next step's, say a worker's

    store.complete_step(0, "done", {}, json.dumps({"round": 1}))
    kept_until_retired = [u[:2] for u in store.updates(0)]
    store.retire_done_steps()  # as the engine does once step 1's tasks are out

    assert kept_until_retired == [("a", "m1"), ("b", "m2")]
    assert store.updates(0) == [] and [u[:2] for u in store.updates(1)] == [("a", "early")]
    assert store.stored_msgs(["m1", "m2", "m3"]) == {"m1", "m2"}  # resent: acked again
    assert store.has_update_msg("m2") and not store.has_update_msg("m3")
    assert store.aggregated(0) == [("a", "m1"), ("b", "m2")] and store.aggregated(1) == []
    assert step_dirs(tmp_path, store) == ["1"]


def test_a_long_run_keeps_one_step_of_replies_and_a_window_of_ids(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    devices = [f"d{i}" for i in range(20)]
    steps = AGGREGATED_STEPS + 6

    for idx in range(steps):
        open_step(store, idx, devices)
        with store.transaction():
            store.add_updates([(idx, d, f"m{idx}.{d}", "t", REPLY) for d in devices])
        store.complete_step(idx, "done", {}, json.dumps({"round": idx + 1}))
        store.retire_done_steps()

    assert store.db.execute("SELECT COUNT(*) FROM updates").fetchone() == (0,)
    kept = store.db.execute("SELECT MIN(step), MAX(step), COUNT(*) FROM aggregated").fetchone()
    assert kept == (6, steps - 1, AGGREGATED_STEPS * len(devices))
    assert step_dirs(tmp_path, store) == []
    assert not store.has_update_msg("m5.d0") and store.has_update_msg("m6.d0")
    # the database holds ids, not the run's replies (1,400 of them, 11.8 MB, if it kept their bytes)
    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert (tmp_path / "s.sqlite").stat().st_size < steps * len(devices) * len(REPLY) // 20


def test_a_step_that_missed_quorum_keeps_its_replies_for_the_retry(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    open_step(store, 0, ["a"])
    store.add_update(0, "a", "m1", "t", REPLY)

    store.complete_step(0, "failed", {}, json.dumps({"round": 1, "quorum_met": False}))
    store.retire_done_steps()

    assert store.updates(0) == [("a", "m1", REPLY)] and step_dirs(tmp_path, store) == ["0"]
    assert store.db.execute("SELECT COUNT(*) FROM aggregated").fetchone() == (0,)


def test_a_quarantined_step_keeps_its_bytes_in_sqlite(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    open_step(store, 0, ["a", "b"])
    store.add_updates([(0, "a", "m1", "t1", REPLY), (0, "b", "m2", "t2", b"short")])

    store.fail_step(0, json.dumps({"round": 1}), "shapes differ")

    rows = store.db.execute("SELECT device_id, task_id, envelope, reason FROM quarantine")
    assert sorted(rows) == [
        ("a", "t1", REPLY, "shapes differ"),
        ("b", "t2", b"short", "shapes differ"),
    ]
    assert step_dirs(tmp_path, store) == [] and store.stored_msgs(["m1", "m2"]) == {"m1", "m2"}


def test_an_unreadable_reply_comes_back_empty_with_the_reason_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store(tmp_path / "s.sqlite")
    open_step(store, 0, ["a", "b"])
    store.add_updates([(0, "a", "m1", "t", REPLY), (0, "b", "m2", "t", b"fine")])
    (rel,) = {row[0] for row in store.db.execute("SELECT seg FROM updates")}
    with (tmp_path / SEGMENTS_DIR / rel).open("r+b") as f:
        f.truncate(len(REPLY) // 2)  # a's bytes cut short, b's gone with them

    with caplog.at_level(logging.ERROR, "edgefl.coordinator.store.segments"):
        rows = Store(tmp_path / "s.sqlite").updates(0)

    assert rows == [("a", "m1", b""), ("b", "m2", b"")]  # still there: each device replied
    assert f"{len(REPLY) // 2} of {len(REPLY)} bytes" in caplog.text


def test_a_store_written_before_segments_reads_its_replies_and_drops_them_when_done(
    tmp_path: Path,
) -> None:
    # Prepare: the updates table as stores before segments made it, with one reply in it
    path = tmp_path / "s.sqlite"
    old = sqlite3.connect(path)
    old.execute(
        "CREATE TABLE updates (step INTEGER NOT NULL, device_id TEXT NOT NULL, msg_id TEXT NOT "
        "NULL, task_id TEXT NOT NULL, envelope BLOB NOT NULL, received REAL NOT NULL, "
        "PRIMARY KEY (step, device_id))"
    )
    old.execute("INSERT INTO updates VALUES (0, 'a', 'old', 't', ?, 0)", (REPLY,))
    old.commit()
    old.close()

    # Execute: the store adds its columns; a new reply goes to a segment
    store = Store(path)
    open_step(store, 0, ["a", "b"])
    store.add_update(0, "b", "new", "t", b"segment bytes")
    reopened = Store(path)  # a second opening finds the columns there

    # Assert
    assert reopened.updates(0) == [("a", "old", REPLY), ("b", "new", b"segment bytes")]
    store.complete_step(0, "done", {}, json.dumps({"round": 1}))
    store.retire_done_steps()
    assert store.updates(0) == [] and store.stored_msgs(["old", "new"]) == {"old", "new"}
    reopened.close()
    store.close()


def test_a_reply_resent_after_its_step_retired_is_acknowledged_until_the_window_ends(
    tmp_path: Path,
) -> None:
    # Prepare: device a's reply of step 0 aggregated and retired; step 1 open
    store = Store(tmp_path / "s.sqlite")
    cfg = run_config(tmp_path, "fedproto")
    desk = ReplyDesk(create_strategy("fedproto", cfg.algorithm_config(), num_classes=10), store)
    old = Envelope(body=Reply(task_id="t.0.0.a", round=1, phase="train", num_samples=1), sender="a")
    open_step(store, 0, ["a"])
    store.add_update(0, "a", old.msg_id, "t.0.0.a", b"bytes")
    store.complete_step(0, "done", {}, json.dumps({"round": 1}))
    open_step(store, 1, ["a"])
    store.retire_done_steps()
    assert isinstance(old.body, Reply)

    # Execute: the agent never got its ack and sends the reply again
    resent = desk.judge(old, old.body, Step(2, "train"), "t.1.0.a", None)

    # Assert: acknowledged as stored (the agent drops it from its outbox), not stored again
    assert resent.ack == Ack(ref_id=old.msg_id, task_id="t.0.0.a") and not resent.store
    store.db.execute("DELETE FROM aggregated")  # as AGGREGATED_STEPS steps later
    late = desk.judge(old, old.body, Step(2, "train"), "t.1.0.a", None)
    assert late.ack is not None and not late.ack.accepted and late.reject is not None
    assert late.reject[0] == "late"
