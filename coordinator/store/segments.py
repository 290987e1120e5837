"""Reply payloads in append-only segment files beside the store.

SQLite keeps a reply's row (device, message id, task, when) and where its bytes are; the bytes
themselves go to ``RUN_DIR/replies/<step>/<pid>-<token>.seg``, a file only this process
appends to. Kept in SQLite, an 8-12 KB reply is written twice (its write-ahead log pages, then
the checkpoint's copy into the database) through four overflow pages, ~45 us of CPU a reply
on this project's VM against ~20 us here, and a finished step's rows cost ~0.5 s to delete at
10,000 agents; a segment directory goes with one ``rmtree``. Figures:
``docs/howto/run-at-scale.md``.

Durability: :meth:`Segments.append` returns only after ``fdatasync`` (and, for a new file or
step directory, an ``fsync`` of the directory that names it), and the store commits the rows
that point into a segment after that; a crash between the two leaves unreferenced bytes, never
a row without its bytes. Each process writes its own file (its pid and a random token in the
name), so no two writers share an offset, and a restarted process starts a new file.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
from pathlib import Path

__all__ = ["SEGMENTS_DIR", "SegmentRef", "Segments"]

SEGMENTS_DIR = "replies"  # beside state.sqlite in the run directory
SegmentRef = tuple[str, int, int]  # (step/file.seg, offset, length)
_NAME = re.compile(r"[0-9]+/[0-9]+-[0-9a-f]{8}\.seg")  # what this module writes, and nothing else

log = logging.getLogger("edgefl.coordinator.store.segments")


class Segments:
    """This process's appends to, and anyone's reads from, the segment files under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._name = f"{os.getpid()}-{os.urandom(4).hex()}.seg"
        self._writing: tuple[int, int, str] | None = None  # (step, fd, step/name)
        self._readers: dict[str, int] = {}  # step/name -> fd
        self._lock = threading.Lock()
        self._removal: threading.Thread | None = None  # the last sweep's unlinking

    def append(self, step: int, blobs: list[bytes]) -> list[SegmentRef]:
        """Write ``blobs`` one after the other to this process's segment of ``step``, durably;
        where each one is. Raises :class:`OSError` (a full disk, say) with nothing referenced."""
        if not blobs:
            return []
        with self._lock:
            fd, rel = self._file(step)
            offset = os.fstat(fd).st_size  # the true end, even after a failed write
            data = memoryview(b"".join(blobs))
            while data:
                data = data[os.write(fd, data) :]
            os.fdatasync(fd)
        refs = []
        for blob in blobs:
            refs.append((rel, offset, len(blob)))
            offset += len(blob)
        return refs

    def read(self, ref: SegmentRef) -> bytes | None:
        """The bytes at ``ref``; ``None`` (logged) if its file is gone, short or not ours."""
        rel, offset, length = ref
        if not _NAME.fullmatch(rel) or offset < 0 or length < 0:
            log.error("reply payload at %r: not a segment reference", ref)
            return None
        try:
            with self._lock:  # a sweep closes these descriptors
                fd = self._readers.get(rel)
                if fd is None:
                    fd = self._readers[rel] = os.open(self.root / rel, os.O_RDONLY | os.O_CLOEXEC)
                data = os.pread(fd, length, offset)
        except OSError as exc:
            log.error("reply payload at %s+%d: %s", rel, offset, exc)
            return None
        if len(data) != length:
            log.error("reply payload at %s+%d: %d of %d bytes", rel, offset, len(data), length)
            return None
        return data

    def sweep(self, upto: int) -> None:
        """Remove the segments of every step up to ``upto`` (their rows are gone). The files
        are unlinked on a thread of its own: freeing a 10,000-agent step's 84 MB took ~57 ms
        on this project's VM, which the round's close need not wait for."""
        with self._lock:
            for rel in [r for r in self._readers if int(r.split("/")[0]) <= upto]:
                os.close(self._readers.pop(rel))
            if self._writing is not None and self._writing[0] <= upto:
                os.close(self._writing[1])
                self._writing = None
        if not self.root.is_dir():
            return
        gone = [e for e in self.root.iterdir() if e.name.isdigit() and int(e.name) <= upto]
        if gone:
            self.join()
            self._removal = threading.Thread(
                target=_remove, args=(gone,), name="edgefl-segment-sweep", daemon=True
            )
            self._removal.start()

    def join(self) -> None:
        """Wait until the last sweep's files are gone."""
        if self._removal is not None:
            self._removal.join()
            self._removal = None

    def close(self) -> None:
        """Close every file, once the last sweep's files are gone (idempotent)."""
        self.join()
        with self._lock:
            fds = list(self._readers.values())
            if self._writing is not None:
                fds.append(self._writing[1])
            self._readers, self._writing = {}, None
        for fd in fds:
            os.close(fd)

    def _file(self, step: int) -> tuple[int, str]:
        """This process's open segment of ``step`` (the previous step's closed)."""
        if self._writing is not None and self._writing[0] == step:
            return self._writing[1], self._writing[2]
        if self._writing is not None:
            os.close(self._writing[1])
            self._writing = None
        folder = self.root / str(step)
        if not folder.is_dir():
            if not self.root.is_dir():
                self.root.mkdir(parents=True, exist_ok=True)
                _sync_dir(self.root.parent)
            folder.mkdir(exist_ok=True)
            _sync_dir(self.root)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
        fd = os.open(folder / self._name, flags, 0o600)
        _sync_dir(folder)  # the new file's name survives a power loss with the rows after it
        rel = f"{step}/{self._name}"
        self._writing = (step, fd, rel)
        return fd, rel


def _remove(folders: list[Path]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
