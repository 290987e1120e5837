"""Broker credentials, TLS files and signing keys, from kits, files and the environment.

Both CLIs (``coordinator serve`` and ``edge-agent``) load what they need to reach a secured
broker here, and only here. Secrets never come from command-line values, which ``ps`` shows to
every user of the machine; the command line names *files* at most.

Sources, the highest precedence first, value by value:

1. ``EDGEFL_*`` environment variables (:data:`ENV`): ``EDGEFL_MQTT_USERNAME``,
   ``EDGEFL_MQTT_PASSWORD``, ``EDGEFL_TLS_CA``, ``EDGEFL_TLS_CERT``, ``EDGEFL_TLS_KEY``,
   ``EDGEFL_SIGNING_KEY``, ``EDGEFL_VERIFY_KEYS``;
2. a credentials file (``--credentials FILE`` or ``EDGEFL_CREDENTIALS``), TOML::

       [mqtt]
       username = "dev-001"
       password = "..."
       [tls]            # paths relative to this file
       ca = "ca.crt"
       cert = "device.crt"
       key = "device.key"
       [signing]
       key = "signing.key"
       verify_keys = "verify"   # a directory of ID.pub files

3. a kit directory (``--kit DIR`` or ``EDGEFL_KIT``) written by ``coordinator provision``:
   ``kit.json`` names the participant, its federation, the broker and the files beside it.

A file that is named but missing is a :class:`~protocol.errors.ConfigError` that says which
source named it. :class:`Credentials` never shows the password in its ``repr``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from protocol.contract.topics import validate_id
from protocol.errors import ConfigError, ValidationError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (JetPack 6)
    import tomli as tomllib

__all__ = [
    "ENV",
    "KIT_FILE",
    "Credentials",
    "KeyDirectory",
    "Kit",
    "SigningKeys",
    "add_arguments",
    "load_credentials",
    "load_signer",
    "load_signing",
    "load_verify_keys",
    "read_kit",
    "write_kit",
]

KIT_FILE = "kit.json"
KIT_VERSION = 1
# every environment variable this module reads, by the value it sets
ENV = {
    "kit": "EDGEFL_KIT",
    "credentials": "EDGEFL_CREDENTIALS",
    "username": "EDGEFL_MQTT_USERNAME",
    "password": "EDGEFL_MQTT_PASSWORD",
    "ca": "EDGEFL_TLS_CA",
    "cert": "EDGEFL_TLS_CERT",
    "key": "EDGEFL_TLS_KEY",
    "signing_key": "EDGEFL_SIGNING_KEY",
    "verify_keys": "EDGEFL_VERIFY_KEYS",
}
_FILE_KEYS = {
    "mqtt": {"username", "password"},
    "tls": {"ca", "cert", "key"},
    "signing": {"key", "verify_keys"},
}
_KIT_KEYS = {"version", "role", "id", "federation", "broker", "ca", "cert", "key"}
_KIT_OPTIONAL = {"signing_key", "verify_keys"}
_PATH_VALUES = ("ca", "cert", "key", "signing_key", "verify_keys")

log = logging.getLogger("edgefl.credentials")


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
        k: _existing(root / str(data[k]), f"{manifest} {k}") for k in _PATH_VALUES if k in data
    }
    return Kit(
        path=root.resolve(),
        role=data["role"],
        id=_checked_id(str(data["id"]), f"{manifest} id"),
        federation=_checked_id(str(data["federation"]), f"{manifest} federation"),
        broker=str(data["broker"]),
        **files,
    )


def _checked_id(value: str, field: str) -> str:
    try:
        return validate_id(value, field)
    except ValidationError as exc:  # a bad local file is a configuration error
        raise ConfigError(str(exc)) from exc


def _existing(path: Path, source: str) -> Path:
    if not path.exists():
        raise ConfigError(f"{source}: {path} does not exist")
    return path.resolve()


@dataclass(frozen=True)
class Credentials:
    """What a client needs to reach a secured broker and to sign; secrets hidden from ``repr``.

    ``sources`` says where each value came from (``EDGEFL_MQTT_PASSWORD``, ``--credentials
    /etc/edgefl/creds.toml``, ``kit /opt/kit``), for logs; it never holds a value.
    """

    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    signing_key: Path | None = None
    verify_keys: Path | None = None
    kit: Kit | None = None
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def tls(self) -> bool:
        """Whether the connection uses TLS (a CA bundle is known)."""
        return self.ca is not None

    def transport_options(self) -> dict[str, Any]:
        """Keyword arguments for :class:`~protocol.transport.paho.MqttTransport`."""
        from protocol.transport.paho import TlsOptions

        tls = None
        if self.ca is not None:
            tls = TlsOptions(
                ca_certs=str(self.ca),
                certfile=None if self.cert is None else str(self.cert),
                keyfile=None if self.key is None else str(self.key),
            )
        return {"username": self.username, "password": self.password, "tls": tls}

    def describe(self) -> str:
        """Where each value came from, for a log line (no value is shown)."""
        if not self.sources:
            return "no credentials (anonymous, plain TCP)"
        by_source: dict[str, list[str]] = {}
        for name, src in self.sources.items():
            by_source.setdefault(src, []).append(name)
        return "; ".join(f"{', '.join(names)} from {src}" for src, names in by_source.items())


def load_credentials(
    *,
    kit: str | Path | None = None,
    credentials_file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Credentials:
    """Merge environment, credentials file and kit (in that precedence) into credentials.

    ``kit`` and ``credentials_file`` come from the command line; when ``None`` the
    ``EDGEFL_KIT`` and ``EDGEFL_CREDENTIALS`` variables are used instead.

    Raises:
        ConfigError: a named kit, file or key that does not exist or cannot be read, an
            unknown key in the credentials file, a certificate without its key.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    kit_obj = _kit_layer(kit, env, values, sources)
    _file_layer(credentials_file, env, values, sources)
    _env_layer(env, values, sources)
    if (values.get("cert") is None) != (values.get("key") is None):
        raise ConfigError(
            "TLS client certificate and key go together: got "
            + ("a certificate without a key" if values.get("cert") else "a key without a cert")
            + f" ({'; '.join(f'{k} from {v}' for k, v in sorted(sources.items()))})"
        )
    if values.get("cert") is not None and values.get("ca") is None:
        raise ConfigError(
            f"TLS client certificate from {sources['cert']} but no CA bundle: set "
            f"{ENV['ca']} or [tls] ca"
        )
    return Credentials(kit=kit_obj, sources=sources, **values)


def _kit_layer(
    kit: str | Path | None, env: Mapping[str, str], values: dict[str, Any], src: dict[str, str]
) -> Kit | None:
    source = "--kit"
    if kit is None and env.get(ENV["kit"]):
        kit, source = env[ENV["kit"]], ENV["kit"]
    if kit is None:
        return None
    loaded = read_kit(kit, source)
    # no username: with `use_identity_as_username` the broker takes the certificate's CN
    for name in _PATH_VALUES:
        if getattr(loaded, name) is not None:
            values[name], src[name] = getattr(loaded, name), f"kit {loaded.path}"
    return loaded


def _file_layer(
    path: str | Path | None, env: Mapping[str, str], values: dict[str, Any], src: dict[str, str]
) -> None:
    source = "--credentials"
    if path is None and env.get(ENV["credentials"]):
        path, source = env[ENV["credentials"]], ENV["credentials"]
    if path is None:
        return
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{source} {file}: no such credentials file")
    try:
        data = tomllib.loads(file.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{source} {file}: unreadable credentials file: {exc}") from exc
    for section, keys in data.items():
        known = _FILE_KEYS.get(section)
        if known is None or not isinstance(keys, dict) or not set(keys) <= known:
            raise ConfigError(
                f"{file}: unknown section or key in [{section}]; expected "
                + ", ".join(f"[{s}] {'/'.join(sorted(k))}" for s, k in _FILE_KEYS.items())
            )
    mqtt, tls, signing = (data.get(s, {}) for s in ("mqtt", "tls", "signing"))
    where = f"{source} {file}"
    for name, value in mqtt.items():
        if not isinstance(value, str):
            raise ConfigError(
                f"{file} [mqtt] {name}: expected a string, got {type(value).__name__}"
            )
        values[name], src[name] = value, where
    named = {**tls, **{("signing_key" if k == "key" else k): v for k, v in signing.items()}}
    for name, value in named.items():
        values[name] = _existing(file.parent / str(value), f"{file} {name}")
        src[name] = where
    if "password" in mqtt:
        _warn_if_readable(file)


def _env_layer(env: Mapping[str, str], values: dict[str, Any], src: dict[str, str]) -> None:
    for name in ("username", "password"):
        if env.get(ENV[name]):
            values[name], src[name] = env[ENV[name]], ENV[name]
    for name in _PATH_VALUES:
        var = ENV[name]
        if env.get(var):
            values[name] = _existing(Path(env[var]).expanduser(), var)
            src[name] = var


def _warn_if_readable(file: Path) -> None:
    """A password file others can read is a leak; say so (ssh refuses, we only warn)."""
    mode = file.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(
            "%s holds a password and is readable by other users (mode %o): chmod 600 it",
            file,
            stat.S_IMODE(mode),
        )


# -- signing keys (Ed25519, PEM) ---------------------------------------------------------------


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
        _checked_id(p.stem, f"verify key file {p}"): Ed25519VerifyKey(_pem_key(p, False))
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
    """

    def __init__(
        self,
        directory: Path,
        *,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
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
        return self._current()[key_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())


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
    keys = KeyDirectory(peers)
    if not keys:
        raise ConfigError(f"verify keys: {peers} holds no ID.pub file; nobody could be verified")
    source = creds.sources.get("signing_key", "")
    log.info("signing frames as %s; verifying %d peers' keys (from %s)", key_id, len(keys), source)
    return SigningKeys(load_signer(key, key_id), keys, source)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--kit`` and ``--credentials``: the flags name files, never secrets (``ps`` shows argv)."""
    parser.add_argument(
        "--kit",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"kit directory from `coordinator provision` (broker, id, TLS files, signing keys); "
        f"default ${ENV['kit']}",
    )
    parser.add_argument(
        "--credentials",
        type=Path,
        default=None,
        metavar="FILE",
        help="TOML with [mqtt] username/password, [tls] ca/cert/key, [signing] key/verify_keys "
        f"(default ${ENV['credentials']}); ${ENV['username']}, ${ENV['password']}, "
        f"${ENV['ca']}, ${ENV['cert']}, ${ENV['key']} override single values",
    )
    parser.add_argument(
        "--no-signing",
        action="store_true",
        help="do not sign or verify frames even though signing keys are available (a kit has "
        "them; by default every frame is signed and unsigned ones refused, WIRE.md §7)",
    )
