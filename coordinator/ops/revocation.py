"""The coordinator kit's revocation list: the devices a running coordinator must drop.

``coordinator provision`` keeps ``OUT/coordinator/revoked`` (one device id a line, ``#``
comments) next to the coordinator's kit; ``provision revoke`` adds to it, ``provision add``
takes a re-issued id off it. The CRL is the broker's list (certificate serials, read only at a
broker's reload); this one is the coordinator's (device ids), and ``coordinator serve --kit``
reads it again whenever it changes (:class:`RevocationWatch`), so that a device revoked while
its connection stays open is no longer selected nor waited for. torch-free and
cryptography-free: the engine imports it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path

from protocol.contract.topics import validate_id
from protocol.errors import ValidationError
from protocol.security.kit import Kit

__all__ = ["REVOKED_FILE", "RevocationWatch", "kit_revocations", "write_revoked"]

REVOKED_FILE = "revoked"
POLL_S = 1.0  # how often the file's status is looked at, at most (one stat call)


def write_revoked(path: Path, ids: Iterable[str]) -> None:
    """Write the list at ``path`` in one step (a coordinator reading it never sees half)."""
    lines = ["# devices revoked by `coordinator provision revoke`: a running coordinator drops"]
    lines += ["# them; one id a line", *sorted(set(ids))]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.chmod(0o644)
    tmp.replace(path)


def kit_revocations(kit: Kit | None) -> Path | None:
    """The revocation list of a coordinator's kit (``None``: no kit, or a device's)."""
    if kit is None or kit.role != "coordinator":
        return None
    return kit.path / REVOKED_FILE


class RevocationWatch:
    """The ids a revocation list names, read again when the file changes.

    A missing file names nobody (a kit provisioned before the list existed, until its first
    revocation). An unreadable line is logged and skipped: a typo must not end a run.
    """

    def __init__(self, path: Path, log: logging.Logger, poll_s: float = POLL_S) -> None:
        self.path = path
        self.log = log
        self.poll_s = poll_s
        self._stamp: tuple[int, int, int] | None = None
        self._next = 0.0  # monotonic time of the next look at the file

    def poll(self) -> frozenset[str] | None:
        """The ids listed now if the file changed since the last call (the first call reads
        it), else ``None``; looks at the file at most once every ``poll_s`` seconds."""
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + self.poll_s
        try:
            st = self.path.stat()
        except FileNotFoundError:
            stamp = (0, 0, 0)
        except OSError as exc:
            self.log.error("revocation list %s unreadable: %s", self.path, exc)
            return None
        else:
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        return self._read() if stamp != (0, 0, 0) else frozenset()

    def _read(self) -> frozenset[str] | None:
        try:
            text = self.path.read_text()
        except OSError as exc:  # replaced between stat and read: the next poll reads it
            self._stamp = None
            self.log.error("revocation list %s unreadable: %s", self.path, exc)
            return None
        ids = set()
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            try:
                ids.add(validate_id(line, "device id"))
            except ValidationError as exc:
                self.log.error("%s:%d skipped: %s", self.path, number, exc)
        return frozenset(ids)
