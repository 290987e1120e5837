"""An agent's durable state: checkpoint, completed tasks and the outbox of unacknowledged replies.

Files are written atomically (temp file + ``os.replace``) so a crash never leaves a torn file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from protocol.contract.codec import Envelope, decode, encode
from protocol.errors import ProtocolError

__all__ = ["AgentState", "atomic_write"]

KEEP_COMPLETED = 256


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        Path(tmp).replace(path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class AgentState:
    """The state directory of one agent."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.outbox_dir = root / "outbox"
        self.outbox_dir.mkdir(parents=True, exist_ok=True)
        self._meta_path = root / "agent.json"
        self.meta: dict[str, object] = self._load_meta()

    @property
    def checkpoint_path(self) -> Path:
        """Where the model checkpoint lives."""
        return self.root / "checkpoint.pt"

    def _load_meta(self) -> dict[str, object]:
        if not self._meta_path.exists():
            return {"completed": {}}
        try:
            meta = json.loads(self._meta_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ProtocolError(f"agent state {self._meta_path} is unreadable: {exc}") from exc
        if not isinstance(meta, dict) or not isinstance(meta.get("completed"), dict):
            raise ProtocolError(f"agent state {self._meta_path}: expected a map with 'completed'")
        return meta

    def _completed(self) -> dict[str, str]:
        return self.meta["completed"]  # type: ignore[return-value]

    def completed_reply(self, task_id: str) -> str | None:
        """Message id of the reply already produced for ``task_id``, if any."""
        return self._completed().get(task_id)

    def mark_completed(self, task_id: str, reply_id: str) -> None:
        """Record that ``task_id`` was answered by message ``reply_id`` (bounded history)."""
        done = self._completed()
        done[task_id] = reply_id
        while len(done) > KEEP_COMPLETED:
            done.pop(next(iter(done)))
        atomic_write(self._meta_path, json.dumps(self.meta).encode())

    def put_outbox(self, topic: str, env: Envelope) -> None:
        """Persist a reply until the coordinator acknowledges it."""
        record = json.dumps({"topic": topic}).encode() + b"\n" + encode(env)
        atomic_write(self.outbox_dir / f"{env.msg_id}.msg", record)

    def ack(self, msg_id: str) -> bool:
        """Drop an acknowledged message; ``True`` if it was pending."""
        path = self.outbox_dir / f"{msg_id}.msg"
        if path.exists():
            path.unlink()
            return True
        return False

    def pending(self) -> list[tuple[str, Envelope]]:
        """Unacknowledged messages, oldest first (corrupt entries are skipped and removed)."""
        out: list[tuple[str, Envelope]] = []
        for path in sorted(self.outbox_dir.glob("*.msg"), key=lambda p: p.stat().st_mtime):
            try:
                head, _, body = path.read_bytes().partition(b"\n")
                out.append((str(json.loads(head)["topic"]), decode(body)))
            except (OSError, ValueError, KeyError, ProtocolError):
                path.unlink(missing_ok=True)
        return out
