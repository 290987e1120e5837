"""The run directory's lock: one coordinator process per run directory.

Two coordinators on one run directory would both write its database and answer the same
agents. ``coordinator status``/``runs``/``stop`` read who holds it without taking it.
"""

from __future__ import annotations

from pathlib import Path

from protocol.dir_lock import DirBusyError, DirLock
from protocol.dir_lock import lock_holder as _holder

__all__ = ["LOCK_FILE", "RunDirBusyError", "RunDirLock", "lock_holder"]

LOCK_FILE = "coordinator.lock"  # in the run directory; holds the pid of the coordinator


class RunDirBusyError(DirBusyError):
    """Another coordinator process holds the run directory."""


class RunDirLock(DirLock):
    """The run directory's :class:`~protocol.dir_lock.DirLock` (``coordinator.lock``)."""

    def __init__(self, run_dir: Path) -> None:
        busy = "run directory {directory} is in use by another coordinator (pid {pid})"
        super().__init__(run_dir, LOCK_FILE, (RunDirBusyError, busy))


def lock_holder(run_dir: Path | str) -> int | None:
    """The pid of the coordinator holding ``run_dir``, or ``None`` if no process holds it."""
    return _holder(run_dir, LOCK_FILE)
