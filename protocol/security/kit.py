"""A participant's kit: ``kit.json`` naming its id, federation, broker and files beside it.

``coordinator provision`` writes one kit per device and one for the coordinator; ``--kit DIR``
(or ``EDGEFL_KIT``) reads it back. Every file a kit names must exist.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from protocol.contract.topics import validate_id
from protocol.errors import ConfigError, ValidationError

__all__ = ["KIT_FILE", "KIT_VERSION", "Kit", "checked_id", "existing_path", "read_kit", "write_kit"]

KIT_FILE = "kit.json"
KIT_VERSION = 1
_KIT_KEYS = {"version", "role", "id", "federation", "broker", "ca", "cert", "key"}
_KIT_OPTIONAL = {"signing_key", "verify_keys"}
_PATH_VALUES = ("ca", "cert", "key", "signing_key", "verify_keys")


@dataclass(frozen=True)
class Kit:
    """One participant's kit: who it is, where its broker is, and its files (absolute)."""

    path: Path
    role: Literal["device", "coordinator"]
    id: str
    federation: str
    broker: str  # host:port of the TLS listener
    ca: Path
    cert: Path
    key: Path
    signing_key: Path | None = None  # Ed25519 private key (PEM) of this participant
    verify_keys: Path | None = None  # directory of the peers' Ed25519 public keys (ID.pub)

    def to_json(self) -> dict[str, Any]:
        """The ``kit.json`` form: file names relative to the kit directory."""
        out: dict[str, Any] = {
            "version": KIT_VERSION,
            "role": self.role,
            "id": self.id,
            "federation": self.federation,
            "broker": self.broker,
        }
        for name in _PATH_VALUES:
            value = getattr(self, name)
            if value is not None:
                out[name] = os.path.relpath(value, self.path)
        return out


def write_kit(kit: Kit) -> Path:
    """Write ``kit.json`` into ``kit.path``; returns its path."""
    target = kit.path / KIT_FILE
    target.write_text(json.dumps(kit.to_json(), indent=2) + "\n")
    return target


def read_kit(path: str | Path, source: str = "--kit") -> Kit:
    """Read a kit directory; every file it names must exist.

    Raises:
        ConfigError: no such directory, no or invalid ``kit.json``, a missing file; the message
            names ``source`` (the flag or variable that gave the path).
    """
    root = Path(path).expanduser()
    manifest = root / KIT_FILE
    if not root.is_dir():
        raise ConfigError(f"{source} {root}: no such kit directory")
    if not manifest.is_file():
        raise ConfigError(
            f"{source} {root}: not a kit (no {KIT_FILE}; see `coordinator provision`)"
        )
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{source} {manifest}: unreadable kit manifest: {exc}") from exc
    if not isinstance(data, dict) or not _KIT_KEYS <= set(data) <= _KIT_KEYS | _KIT_OPTIONAL:
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ConfigError(
            f"{manifest}: expected keys {sorted(_KIT_KEYS)} (+ {sorted(_KIT_OPTIONAL)}), got {got}"
        )
    if data["version"] != KIT_VERSION or data["role"] not in ("device", "coordinator"):
        raise ConfigError(
            f"{manifest}: expected version {KIT_VERSION} and role device|coordinator, got "
            f"version {data['version']!r}, role {data['role']!r}"
        )
    files = {
        k: existing_path(root / str(data[k]), f"{manifest} {k}") for k in _PATH_VALUES if k in data
    }
    return Kit(
        path=root.resolve(),
        role=data["role"],
        id=checked_id(str(data["id"]), f"{manifest} id"),
        federation=checked_id(str(data["federation"]), f"{manifest} federation"),
        broker=str(data["broker"]),
        **files,
    )


def checked_id(value: str, field: str) -> str:
    try:
        return validate_id(value, field)
    except ValidationError as exc:  # a bad local file is a configuration error
        raise ConfigError(str(exc)) from exc


def existing_path(path: Path, source: str) -> Path:
    if not path.exists():
        raise ConfigError(f"{source}: {path} does not exist")
    return path.resolve()
