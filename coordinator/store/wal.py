"""WAL checkpoints off the writing thread.

SQLite in WAL mode appends every committed page to the ``-wal`` file and, by default, the
connection whose commit takes the log past 1000 pages copies the log back into the database
(a *checkpoint*: the same bytes written a second time, and an fsync of the database) inside
that commit. For the coordinator that is the engine's thread, which then acknowledges nothing
until the copy is done: at 1000 agents' 8.4 KB replies a round, a checkpoint every ~450
replies. A :class:`WalCheckpointer` runs the checkpoints on a thread and connection of its
own instead (``PRAGMA wal_checkpoint(PASSIVE)``: it never blocks a writer or a reader, and
copies what it can), and the writing connections turn their automatic checkpoints off
(:class:`~coordinator.store.database.Store`'s ``checkpoint_s``).

Durability is unchanged: a commit is durable once its log frames are synced
(``synchronous=FULL``); a checkpoint only moves them. The log restarts from its beginning
once a checkpoint has copied all of it, so it stays about one burst long
(``journal_size_limit`` truncates it back after a larger one). Figures:
``docs/howto/run-at-scale.md``.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

__all__ = ["WalCheckpointer"]

log = logging.getLogger("edgefl.coordinator.store.wal")


class WalCheckpointer:
    """Checkpoints the WAL of the database at ``path`` every ``interval_s`` on its own thread."""

    def __init__(self, path: Path, interval_s: float) -> None:
        self.path = path
        self.interval_s = interval_s
        self.passes = 0  # checkpoints run (for tests and logs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"edgefl-checkpoint-{self.path.name}", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread after its current pass (the last connection's close checkpoints
        what is left)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def stop_soon(self) -> None:
        """Let the thread end after its current pass, without waiting for it."""
        self._stop.set()

    def checkpoint(self, db: sqlite3.Connection) -> tuple[int, int, int]:
        """One passive checkpoint on ``db``: (busy, frames in the log, frames copied)."""
        row = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        self.passes += 1
        return int(row[0]), int(row[1]), int(row[2])

    def _run(self) -> None:
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:  # the writers checkpoint nothing either: say so
            log.error("no WAL checkpoints of %s: %s", self.path, exc)
            return
        try:
            while not self._stop.wait(self.interval_s):
                try:
                    self.checkpoint(db)
                except sqlite3.Error as exc:  # another process's checkpoint runs: next time
                    log.debug("WAL checkpoint of %s skipped: %s", self.path, exc)
        finally:
            db.close()
