"""Signing keys (Ed25519, PEM): this participant's signer and its peers' verify keys.

The peers' public keys are a directory of ``ID.pub`` files, read again when it changes, so that
``coordinator provision add|revoke`` takes effect without a restart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.errors import ConfigError
from protocol.security.credentials import ENV, Credentials
from protocol.security.kit import checked_id

__all__ = ["KeyDirectory", "SigningKeys", "load_signer", "load_signing", "load_verify_keys"]

log = logging.getLogger("edgefl.credentials")


def load_signer(path: Path, key_id: str) -> Any:
    """An :class:`~protocol.security.signing.Ed25519Signer` from a PEM private key file (PKCS#8)."""
    from protocol.security.signing import Ed25519Signer

    raw = _pem_key(path, private=True)
    return Ed25519Signer(key_id, raw)


def load_verify_keys(directory: Path) -> dict[str, Any]:
    """``{key id: Ed25519VerifyKey}`` from ``ID.pub`` PEM files (the key id is the file name)."""
    from protocol.security.signing import Ed25519VerifyKey

    if not directory.is_dir():
        raise ConfigError(f"verify keys: {directory} is not a directory of ID.pub files")
    return {
        checked_id(p.stem, f"verify key file {p}"): Ed25519VerifyKey(_pem_key(p, False))
        for p in sorted(directory.glob("*.pub"))
    }


class KeyDirectory(Mapping[str, Any]):
    """The peers' public keys in a directory of ``ID.pub`` files, read again when the directory
    changes, so that a device added or revoked (``coordinator provision add|revoke``) is
    verified or refused while the run goes on, without a restart.

    The directory's modification time is checked at most every ``interval`` seconds (a stat,
    not a read). A reload that fails (a key file being written) keeps the previous keys and is
    tried again at the next check. Keys are only ever added or deleted as whole files by
    provisioning, which changes the directory's time; a key replaced in place is not noticed.

    ``own`` are keys held beside the directory that no file in it can replace: the
    participant's own public key under its own id, which its other processes (a coordinator's
    ingest workers) sign with.
    """

    def __init__(
        self,
        directory: Path,
        *,
        own: Mapping[str, Any] | None = None,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self.own = dict(own or {})
        self.interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._stamp = self._mtime()
        self._keys = load_verify_keys(directory)  # at start, a bad directory is an error
        self._checked = clock()

    def _mtime(self) -> int | None:
        try:
            return self.directory.stat().st_mtime_ns
        except OSError:
            return None

    def _current(self) -> dict[str, Any]:
        if self._clock() - self._checked < self.interval:
            return self._keys
        with self._lock:
            self._checked = self._clock()
            stamp = self._mtime()  # before reading: a change during the read is seen next time
            if stamp == self._stamp:
                return self._keys
            try:
                keys = load_verify_keys(self.directory)
            except ConfigError as exc:
                log.error("verify keys: keeping the previous %d keys: %s", len(self._keys), exc)
                return self._keys
            added, gone = sorted(keys.keys() - self._keys), sorted(self._keys.keys() - keys)
            log.info("verify keys of %s changed: added %s, removed %s", self.directory, added, gone)
            self._keys, self._stamp = keys, stamp
            return keys

    def __getitem__(self, key_id: str) -> Any:
        if key_id in self.own:  # a peer's file named after this participant verifies nothing
            return self.own[key_id]
        return self._current()[key_id]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.own.keys() | self._current().keys()))

    def __len__(self) -> int:
        return len(self.own.keys() | self._current().keys())

    def peers(self) -> list[str]:
        """The ids of the directory's keys, but this participant's own."""
        return sorted(self._current().keys() - self.own.keys())


def _pem_key(path: Path, private: bool) -> bytes:
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:
        raise ConfigError(
            "signing keys need the 'cryptography' package: pip install edgefl[signing]"
        ) from exc
    try:
        data = path.read_bytes()
        key: Any = (
            serialization.load_pem_private_key(data, password=None)
            if private
            else serialization.load_pem_public_key(data)
        )
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"signing key {path}: unreadable PEM key: {exc}") from exc
    if private and isinstance(key, ed25519.Ed25519PrivateKey):
        raw: bytes = key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
    elif not private and isinstance(key, ed25519.Ed25519PublicKey):
        raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    else:
        raise ConfigError(f"signing key {path}: expected an Ed25519 key, got {type(key).__name__}")
    return raw


@dataclass(frozen=True)
class SigningKeys:
    """This participant's signer and its peers' public keys: what signed frames need (§7)."""

    signer: Any  # protocol.security.signing.Ed25519Signer; key id = this participant's sender id
    verify_keys: Mapping[str, Any]  # key id -> protocol.security.signing.VerifyKey
    source: str = ""  # where the keys came from, for logs

    def endpoint_options(self, unsigned_kinds: frozenset[str]) -> dict[str, Any]:
        """Keyword arguments for :class:`~protocol.transport.endpoint.Endpoint`: sign every frame,
        require
        signatures, accept only ``unsigned_kinds`` (the last wills) unsigned.

        Each call makes a new :class:`~protocol.security.signing.Verifier` (its own replay cache):
        two
        endpoints sharing one would refuse each other's copy of a retained message as a replay.
        """
        return {
            "signer": self.signer,
            "verifier": self.verifier(),
            "require_signatures": True,
            "unsigned_kinds": unsigned_kinds,
        }

    def verifier(self) -> Any:
        """A new :class:`~protocol.security.signing.Verifier` of the peers' keys (its own replay
        cache)."""
        from protocol.security.signing import Verifier

        return Verifier(self.verify_keys)  # a KeyDirectory keeps following its directory


def load_signing(creds: Credentials, key_id: str, *, enabled: bool = True) -> SigningKeys | None:
    """The signing keys ``creds`` locate, for participant ``key_id``; ``None`` when off.

    Signing is on whenever a signing key is known (a kit has one) unless ``enabled`` is false
    (``--no-signing``, logged as a warning). A signing key without verify keys, or the other
    way round, is a :class:`ConfigError`: half a key set would fail every frame at run time.
    """
    key, peers = creds.signing_key, creds.verify_keys
    if not enabled:
        if key is not None or peers is not None:
            log.warning(
                "--no-signing: frames are neither signed nor verified although signing keys "
                "are available (%s); any client of the broker can speak for any participant",
                creds.sources.get("signing_key") or creds.sources.get("verify_keys"),
            )
        return None
    if key is None and peers is None:
        log.info("frames are not signed: no signing key (a kit from `coordinator provision`)")
        return None
    if key is None or peers is None:
        given, missing, file_key = (
            ("signing_key", "verify_keys", "verify_keys")
            if key is not None
            else ("verify_keys", "signing_key", "key")
        )
        raise ConfigError(
            f"{given} from {creds.sources[given]} but no {missing}: set {ENV[missing]} or "
            f"[signing] {file_key}, or run with --no-signing"
        )
    signer = load_signer(key, key_id)
    # its own public key too: its other processes (a coordinator's ingest workers) sign as it
    keys = KeyDirectory(peers, own={key_id: signer.verify_key()})
    if not keys.peers():
        raise ConfigError(
            f"verify keys: {peers} holds no peer's ID.pub file; nobody could be verified"
        )
    source = creds.sources.get("signing_key", "")
    log.info(
        "signing frames as %s; verifying its own and %d peers' keys (from %s)",
        key_id,
        len(keys.peers()),
        source,
    )
    return SigningKeys(signer, keys, source)
