"""WAL checkpoints on a thread of their own: the writer never checkpoints in its commits, the
log is copied back in the background, and what was committed survives a reopen."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest
from helpers import wait_for

from coordinator.store.database import StepRecord, Store
from coordinator.store.wal import WalCheckpointer

BLOB = bytes(range(256)) * 33  # ~8.4 KB: a FedProto reply


def rows(n: int, step: int = 0) -> list[tuple[int, str, str, str, bytes]]:
    return [(step, f"d{i:04d}", f"m{step}.{i}", "t", BLOB) for i in range(n)]


def wal_frames(path: Path) -> int:
    """Frames in the log that no checkpoint has copied yet (a passive pass that copies none)."""
    db = sqlite3.connect(path)
    try:
        _busy, log, copied = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        return int(log) - int(copied)
    finally:
        db.close()


def test_the_writer_leaves_checkpoints_to_the_thread(tmp_path: Path) -> None:
    # Prepare: a store whose checkpointer waits an hour between passes
    store = Store(tmp_path / "s.sqlite", checkpoint_s=3600.0)
    assert store.db.execute("PRAGMA wal_autocheckpoint").fetchone() == (0,)
    assert store.checkpointer is not None
    # Execute: 1,500 registrations of ~8.4 KB in batches (replies' bytes go to segments):
    # ~4,500 log pages, past SQLite's 1,000-page default
    for i in range(0, 1500, 100):
        with store.transaction():
            store.upsert_agents({f"d{k:04d}": BLOB for k in range(i, i + 100)})
    # Assert: nothing was copied back by the commits; one pass copies everything
    size = (tmp_path / "s.sqlite-wal").stat().st_size
    assert size > 1500 * len(BLOB)
    busy, log, copied = store.checkpointer.checkpoint(store.db)
    assert (busy, copied) == (0, log) and log > 3000
    store.close()
    again = Store(tmp_path / "s.sqlite")
    assert len(again.agents()) == 1500
    again.close()


def test_the_thread_copies_the_log_back_and_stops_with_the_store(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite", checkpoint_s=0.05)
    store.open_step(StepRecord(0, 1, "train", [], "open", 0))
    with store.transaction():
        store.add_updates(rows(200))
    checkpointer = store.checkpointer
    assert checkpointer is not None
    assert wait_for(lambda: checkpointer.passes >= 2 and wal_frames(store.path) == 0, 10)
    thread = checkpointer._thread
    assert thread is not None and thread.is_alive()
    store.close()
    assert not thread.is_alive() and store.checkpointer is None


def test_a_checkpointer_reports_a_database_it_cannot_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = WalCheckpointer(tmp_path / "no" / "such.sqlite", 0.01)
    with caplog.at_level(logging.ERROR, "edgefl.coordinator.store.wal"):
        missing.start()
        missing.stop()
    assert missing.passes == 0
    assert "no WAL checkpoints of" in caplog.text
