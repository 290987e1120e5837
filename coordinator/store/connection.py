"""The coordinator's SQLite file, opened: its schema (and the one migration of an older store),
the pragmas that make an acknowledged update durable, WAL checkpoints off the reply path, and
all-or-nothing transactions.

:class:`StoreConnection` is the base of :class:`~coordinator.store.database.Store`, which keeps
the run's records (agents, steps, replies, global state) in that file.
"""

from __future__ import annotations

import sqlite3
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from coordinator.store.lock import RunDirLock
from coordinator.store.segments import SEGMENTS_DIR, Segments
from coordinator.store.wal import WalCheckpointer

__all__ = ["BUSY_TIMEOUT_S", "CHECKPOINT_S", "SCHEMA", "WAL_SIZE_LIMIT", "StoreConnection"]


SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS agents (device_id TEXT PRIMARY KEY, register BLOB NOT NULL,
    online INTEGER NOT NULL, last_seen REAL NOT NULL);
CREATE TABLE IF NOT EXISTS steps (idx INTEGER PRIMARY KEY, round INTEGER NOT NULL,
    phase TEXT NOT NULL, participants TEXT NOT NULL, status TEXT NOT NULL,
    attempt INTEGER NOT NULL, started REAL NOT NULL, finished REAL);
CREATE TABLE IF NOT EXISTS updates (step INTEGER NOT NULL, device_id TEXT NOT NULL,
    msg_id TEXT NOT NULL, task_id TEXT NOT NULL, envelope BLOB NOT NULL, received REAL NOT NULL,
    seg TEXT, seg_offset INTEGER, seg_length INTEGER, PRIMARY KEY (step, device_id));
-- the replies of done steps, whose rows and payloads are gone: a resend is acknowledged again
CREATE TABLE IF NOT EXISTS aggregated (msg_id TEXT PRIMARY KEY, step INTEGER NOT NULL,
    device_id TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS aggregated_by_step ON aggregated (step);
-- every reply is first checked for a duplicate msg_id: without this, a scan of all updates
CREATE INDEX IF NOT EXISTS updates_by_msg ON updates (msg_id);
-- updates of a step whose aggregation failed: kept for a post-mortem, never aggregated again
CREATE TABLE IF NOT EXISTS quarantine (step INTEGER NOT NULL, device_id TEXT NOT NULL,
    msg_id TEXT NOT NULL, task_id TEXT NOT NULL, envelope BLOB NOT NULL, received REAL NOT NULL,
    reason TEXT NOT NULL, PRIMARY KEY (step, device_id));
CREATE INDEX IF NOT EXISTS quarantine_by_msg ON quarantine (msg_id);
CREATE TABLE IF NOT EXISTS global_state (name TEXT PRIMARY KEY, blob BLOB NOT NULL,
    step INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS metrics (step INTEGER PRIMARY KEY, record TEXT NOT NULL);
-- replies an ingest worker refused as invalid, so that the round leader stops waiting for them
CREATE TABLE IF NOT EXISTS refusals (step INTEGER NOT NULL, attempt INTEGER NOT NULL,
    device_id TEXT NOT NULL, reason TEXT NOT NULL, PRIMARY KEY (step, attempt, device_id));
-- reply and ack bytes the ingest workers moved per step, for the leader's step record
CREATE TABLE IF NOT EXISTS worker_traffic (step INTEGER NOT NULL, key TEXT NOT NULL,
    bytes INTEGER NOT NULL, PRIMARY KEY (step, key));
"""
BUSY_TIMEOUT_S = 30.0  # ingest workers and the leader take turns at the write lock
#: seconds between WAL checkpoints of the stores that take replies (coordinator.store.wal)
CHECKPOINT_S = 0.5
WAL_SIZE_LIMIT = 64 << 20  # bytes a restarted write-ahead log is truncated back to


class StoreConnection:
    """The connection to the store's file, its lock, segments and WAL checkpointer."""

    def __init__(
        self, path: Path | str, *, lock: bool = False, checkpoint_s: float | None = None
    ) -> None:
        """Open (creating) the database; ``lock=True`` first takes the run directory's lock.

        ``checkpoint_s``: copy the write-ahead log into the database every ``checkpoint_s``
        seconds on a thread of its own, not inside this connection's commits
        (:mod:`coordinator.store.wal`); for the processes that write replies.
        """
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lock = RunDirLock(self.path.parent) if lock else None
        self.db = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S
        )
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")  # an acked update must survive power loss
        # told how long each transaction's COMMIT took (the engine's metrics observer); set
        # before the migration below, whose transaction reads it
        self.on_commit: Callable[[float], None] | None = None
        self.db.executescript(SCHEMA)
        self._add_segment_columns()
        self.segments = Segments(self.path.parent / SEGMENTS_DIR)
        self.checkpointer: WalCheckpointer | None = None
        if checkpoint_s is not None:
            self.db.execute("PRAGMA wal_autocheckpoint=0")
            self.db.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
            self.checkpointer = WalCheckpointer(self.path, checkpoint_s)
            self.checkpointer.start()
            # a store dropped without close() must not leave its thread polling
            weakref.finalize(self, self.checkpointer.stop_soon)

    def close(self) -> None:
        """Close the database and release the run directory's lock."""
        if self.checkpointer is not None:
            self.checkpointer.stop()
            self.checkpointer = None
        self.segments.close()
        self.db.close()
        if self.lock is not None:
            self.lock.release()

    def _add_segment_columns(self) -> None:
        """Give a store written before segments its columns (its rows keep their bytes)."""
        columns = (("seg", "TEXT"), ("seg_offset", "INTEGER"), ("seg_length", "INTEGER"))

        def missing() -> list[tuple[str, str]]:
            have = {row[1] for row in self.db.execute("PRAGMA table_info(updates)")}
            return [(name, kind) for name, kind in columns if name not in have]

        if not missing():  # a read: opening a current store takes no write lock
            return
        with self.transaction() as db:  # the write lock: workers open the store at once
            for column, kind in missing():
                db.execute(f"ALTER TABLE updates ADD COLUMN {column} {kind}")  # names above

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """All-or-nothing block."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        started = time.perf_counter()
        self.db.execute("COMMIT")
        if self.on_commit is not None:
            self.on_commit(time.perf_counter() - started)
