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

import logging
import os
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.errors import ConfigError
from protocol.security.kit import Kit, existing_path, read_kit

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (JetPack 6)
    import tomli as tomllib

__all__ = ["ENV", "Credentials", "load_credentials"]

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
_PATH_VALUES = ("ca", "cert", "key", "signing_key", "verify_keys")  # the kit's file values

log = logging.getLogger("edgefl.credentials")


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
        values[name] = existing_path(file.parent / str(value), f"{file} {name}")
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
            values[name] = existing_path(Path(env[var]).expanduser(), var)
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
