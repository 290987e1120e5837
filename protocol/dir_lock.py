"""One process per directory: an exclusive ``flock`` on a lock file that holds the owner's pid.

The coordinator locks its run directory, an edge agent its state directory: two processes on
one would both write its database and answer as the same peer. The kernel drops the lock when
the process dies, so a crash never leaves it stale. A directory the lock created and nothing else
used (a process refused at start) is removed on release, so a failed start leaves no trace.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from protocol.errors import EdgeFLError

__all__ = ["DirBusyError", "DirLock", "lock_holder"]


class DirBusyError(EdgeFLError):
    """Another process holds the directory."""


class DirLock:
    """An exclusive ``flock`` on ``directory/name``, released on :meth:`release` or at exit.

    Args:
        directory: The directory to own (created if missing).
        name: The lock file's name in it.
        busy: The error raised when another process holds it; its message is formatted with
            ``{directory}`` and ``{pid}``.
    """

    def __init__(
        self,
        directory: Path,
        name: str,
        busy: tuple[type[DirBusyError], str] = (DirBusyError, "{directory} is in use by pid {pid}"),
    ) -> None:
        directory = Path(directory)
        self._created = not directory.exists()
        self.path = directory / name
        self._fd: int | None = None
        while self._fd is None:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                error, message = busy
                holder = lock_holder(directory, name)
                raise error(message.format(directory=directory, pid=holder or "unknown")) from None
            if _same_file(fd, self.path):
                self._fd = fd
            else:  # its holder removed it between our open and our lock: lock the one now there
                os.close(fd)
        os.ftruncate(self._fd, 0)
        os.write(self._fd, str(os.getpid()).encode())

    def release(self) -> None:
        """Unlock (idempotent); a directory this lock created that holds nothing else is removed."""
        if self._fd is None:
            return
        directory = self.path.parent
        if self._created and [entry.name for entry in directory.iterdir()] == [self.path.name]:
            # unlinked while still held: a process waiting on the old file sees it gone and
            # retries on a new one (the inode check above), so two holders never coexist
            self.path.unlink()
            with contextlib.suppress(OSError):  # something was written there meanwhile: keep it
                directory.rmdir()
        os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == path.stat().st_ino
    except FileNotFoundError:
        return False


def lock_holder(directory: Path | str, name: str) -> int | None:
    """The pid of the process holding ``directory/name`` (-1: held, pid unreadable), or
    ``None`` if no process holds it."""
    path = Path(directory) / name
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # never held, or its holder released and removed it
        return None
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
