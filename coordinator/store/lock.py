"""The run directory's lock: one coordinator process per run directory.

Two coordinators on one run directory would both write its database and answer the same
agents. ``coordinator status``/``runs``/``stop`` read who holds it without taking it.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from protocol.errors import EdgeFLError

__all__ = ["LOCK_FILE", "RunDirBusyError", "RunDirLock", "lock_holder"]

LOCK_FILE = "coordinator.lock"  # in the run directory; holds the pid of the coordinator


class RunDirBusyError(EdgeFLError):
    """Another coordinator process holds the run directory."""


class RunDirLock:
    """An exclusive ``flock`` on ``RUN_DIR/coordinator.lock``, released on close or on exit.

    Two coordinators on one run directory would both write its database and answer the same
    agents; the kernel drops the lock when the process dies, so a crash never leaves it stale.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            raise RunDirBusyError(
                f"run directory {run_dir} is in use by another coordinator "
                f"(pid {lock_holder(run_dir) or 'unknown'})"
            ) from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, str(os.getpid()).encode())

    def release(self) -> None:
        """Unlock (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def lock_holder(run_dir: Path | str) -> int | None:
    """The pid of the coordinator holding ``run_dir``, or ``None`` if no process holds it."""
    path = Path(run_dir) / LOCK_FILE
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = path.read_text().strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
