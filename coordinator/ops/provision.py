"""``coordinator provision``: a CA, certificates, a Mosquitto config with ACL, and device kits.

Everything is made with the ``cryptography`` package (no ``openssl`` subprocess) into one
directory that the operator keeps (it holds the CA key)::

    OUT/fleet.json                 what was issued and revoked (no secrets)
    OUT/ca/ca.key, ca.crt          the fleet's CA; ca.key never leaves this directory
    OUT/broker/                    copy to the broker host: mosquitto.conf, acl, ca.crt,
                                   server.crt, server.key, crl.pem (empty until a revocation)
    OUT/coordinator/               `coordinator serve --kit OUT/coordinator`
    OUT/devices/ID/                `edge-agent --kit DIR`: kit.json, ca.crt, device.crt,
                                   device.key, signing.key, verify/coordinator.pub
    OUT/devices/ID.tar.gz          the same kit as one archive (``--archive``)

TLS keys are EC P-256; signing keys are Ed25519 (``protocol.security.signing``): each participant's
private key is in its own kit, the public keys of its peers in the kit's ``verify/``
directory. Private keys are written with mode 0600, kit directories 0700.

The ACL uses Mosquitto ``pattern`` rules with ``%u`` (``WIRE.md`` §11), so it names no
device: any certificate of this CA reaches exactly its own topics. A device is revoked
through the CRL, which the config names from the start (empty until then), so that a reload
(SIGHUP) of Mosquitto takes a new one: the broker then refuses the device's TLS handshake.
Its kit and public key are deleted, so the coordinator no longer holds its signing key either,
and its id goes on the coordinator kit's revocation list (``OUT/coordinator/revoked``,
:mod:`coordinator.ops.revocation`), which a running coordinator watches: it stops selecting
the device and waiting for it, even while the device's connection stays open.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from coordinator.ops import pki
from coordinator.ops.revocation import REVOKED_FILE, write_revoked
from protocol.contract.topics import COORDINATOR_ID, PREFIX, validate_id
from protocol.errors import ConfigError, ValidationError
from protocol.security.kit import Kit, write_kit

__all__ = [
    "COORDINATOR_ID",
    "ProvisionSpec",
    "acl_text",
    "add_devices",
    "device_ids",
    "mosquitto_conf",
    "provision",
    "revoke_devices",
    "summary",
]

STATE_FILE = "fleet.json"


@dataclass(frozen=True)
class ProvisionSpec:
    """What ``coordinator provision init`` creates (kept in ``fleet.json``)."""

    federation: str = "default"
    devices: tuple[str, ...] = ()
    hostnames: tuple[str, ...] = ("localhost", "127.0.0.1")  # the broker certificate's SAN
    broker_host: str = ""  # what clients connect to (default: the first hostname)
    port: int = 8883
    ws_port: int = 0  # a listener of MQTT over WebSockets over TLS too (0: none)
    listen: str = ""  # the broker's bind address ("": every interface)
    broker_dir: str = ""  # where OUT/broker's files live on the broker host (default: there)
    days: int = 825  # validity of the leaf certificates
    # Mosquitto started as root drops to its own user *before* it loads the server key: when
    # provisioning as root on the broker host, name that user to give it the key
    broker_user: str = ""
    devices_issued: dict[str, str] = field(default_factory=dict)  # id -> serial (hex)
    revoked: dict[str, str] = field(default_factory=dict)  # serial (hex) -> id

    def __post_init__(self) -> None:
        _checked_id(self.federation, "--federation")
        if not self.hostnames:
            raise ConfigError("--hostname: the broker certificate needs at least one name")
        if not 1 <= self.port <= 65535 or not 1 <= self.days <= pki.CA_DAYS:
            raise ConfigError(
                f"--port 1..65535 and --days 1..{pki.CA_DAYS}, got {self.port} and {self.days}"
            )
        if not 0 <= self.ws_port <= 65535 or self.ws_port == self.port:
            raise ConfigError(
                f"--ws-port: expected 1..65535 other than --port {self.port} (or 0: no "
                f"WebSockets listener), got {self.ws_port}"
            )

    @property
    def broker(self) -> str:
        """``host:port`` the kits point at."""
        return self._netloc(self.port)

    @property
    def websocket_url(self) -> str:
        """``wss://host:port/mqtt`` of the WebSockets listener ("" without one)."""
        return f"wss://{self._netloc(self.ws_port)}/mqtt" if self.ws_port else ""

    def _netloc(self, port: int) -> str:
        host = self.broker_host or self.hostnames[0]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _checked_id(value: str, field: str) -> str:
    """A topic-level id, or a ConfigError (bad operator input, not a bad peer message)."""
    try:
        return validate_id(value, field)
    except ValidationError as exc:
        raise ConfigError(str(exc)) from exc


def device_ids(
    names: Sequence[str] = (),
    count: int = 0,
    prefix: str = "device-",
    skip: Collection[str] = (),
) -> list[str]:
    """Device ids from a list and a count with prefix (``device-001`` ...); validated, unique.

    Counted ids skip the ones in ``skip`` (devices already issued or revoked), so that
    ``provision add --count 2`` continues a counted fleet instead of colliding with it.
    """
    ids = list(names)
    number = 0
    while len(ids) < len(names) + count:
        number += 1
        candidate = f"{prefix}{number:03d}"
        if candidate not in skip and candidate not in ids:
            ids.append(candidate)
    for d in ids:
        _checked_id(d, "device id")
        if d == COORDINATOR_ID:
            raise ConfigError(f"device id {d!r} is reserved for the coordinator")
    dup = sorted({d for d in ids if ids.count(d) > 1})
    if dup:
        raise ConfigError(f"device ids given twice: {dup}")
    return ids


# -- broker config -----------------------------------------------------------------------------


def acl_text(federation: str) -> str:
    """The Mosquitto ACL of ``WIRE.md`` §11 for one federation (``%u`` = certificate CN)."""
    base = f"{PREFIX}/{federation}"
    return (
        f"# edgefl ACL of federation {federation!r} (WIRE.md §11), written by "
        "`coordinator provision`.\n"
        "# Every client logs in with a certificate of this fleet's CA; its username is the\n"
        "# certificate's CN (use_identity_as_username). %u is that username.\n"
        "#\n"
        "# A device reads its own tasks and the federation's broadcasts, and writes only its\n"
        "# own replies, registration, status and progress: never another device's, never the\n"
        "# coordinator's state.\n"
        f"pattern read {base}/dev/%u/down/#\n"
        f"pattern write {base}/dev/%u/up/#\n"
        f"pattern write {base}/dev/%u/status\n"
        f"pattern write {base}/dev/%u/progress\n"
        "# (Mosquitto warns that the next three patterns lack %u: they are the same for all.)\n"
        f"pattern read {base}/bcast/#\n"
        f"pattern read {base}/round\n"
        f"pattern read {base}/coord/state\n"
        "\n"
        "# The coordinator reads and writes the whole federation.\n"
        f"user {COORDINATOR_ID}\n"
        f"topic readwrite {base}/#\n"
    )


def mosquitto_conf(spec: ProvisionSpec, broker_dir: Path) -> str:
    """``mosquitto.conf``: an mTLS listener, and with ``ws_port`` one of MQTT over WebSockets
    over the same mutual TLS; certificate CN as username; ACL; CRL."""
    lines = [
        "# edgefl broker, written by `coordinator provision`: mutual TLS, one ACL.",
        "# After `coordinator provision revoke`: copy crl.pem here and reload mosquitto (SIGHUP).",
        "per_listener_settings false",
        "allow_anonymous false",
        f"acl_file {broker_dir / 'acl'}",
        *_tls_listener(spec.port, spec.listen, broker_dir),
    ]
    if spec.ws_port:
        lines += [
            "# MQTT over WebSockets over TLS (wss://HOST:PORT/mqtt, any path) with the same",
            "# mutual TLS: needs a Mosquitto built with WebSockets (mosquitto.org packages are)",
            *_tls_listener(spec.ws_port, spec.listen, broker_dir),
            "protocol websockets",
        ]
    # the runtime's persistent sessions queue QoS 1 messages while a device is away
    lines += ["set_tcp_nodelay true", "max_queued_messages 100000"]
    return "\n".join(lines) + "\n"


def _tls_listener(port: int, listen: str, d: Path) -> list[str]:
    """A ``listener`` block with the fleet's mutual TLS (TLS options are per listener)."""
    return [
        f"listener {port}" + (f" {listen}" if listen else ""),
        f"cafile {d / 'ca.crt'}",
        f"certfile {d / 'server.crt'}",
        f"keyfile {d / 'server.key'}",
        "require_certificate true",
        "use_identity_as_username true",
        # always named (empty at first): a reload then takes a new CRL, a restart is not needed
        f"crlfile {d / 'crl.pem'}",
    ]


# -- the provisioning directory ------------------------------------------------------------------


class _Fleet:
    """An open provisioning directory: the spec, the CA, and the file layout."""

    def __init__(self, out: Path, spec: ProvisionSpec) -> None:
        self.out = out
        self.spec = spec

    @classmethod
    def open(cls, out: Path) -> _Fleet:
        state = out / STATE_FILE
        if not state.is_file():
            raise ConfigError(f"--out {out}: no {STATE_FILE}; create it with `provision init`")
        data = json.loads(state.read_text())
        data["devices"] = tuple(data["devices"])
        data["hostnames"] = tuple(data["hostnames"])
        return cls(out, ProvisionSpec(**data))

    def save(self) -> None:
        pki.write_public(self.out / STATE_FILE, json.dumps(asdict(self.spec), indent=2) + "\n")
        coordinator = self.out / COORDINATOR_ID
        if coordinator.is_dir():  # the list a running coordinator watches (a re-issued id is off)
            revoked = set(self.spec.revoked.values()) - set(self.spec.devices_issued)
            write_revoked(coordinator / REVOKED_FILE, revoked)

    @property
    def broker_dir(self) -> Path:
        return self.out / "broker"

    def ca(self) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key = serialization.load_pem_private_key((self.out / "ca" / "ca.key").read_bytes(), None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ConfigError(f"{self.out / 'ca' / 'ca.key'}: expected the fleet's EC CA key")
        return key, x509.load_pem_x509_certificate((self.out / "ca" / "ca.crt").read_bytes())

    def write_broker_config(self) -> None:
        d = self.broker_dir
        target = Path(self.spec.broker_dir) if self.spec.broker_dir else d.resolve()
        pki.write_public(d / "acl", acl_text(self.spec.federation))
        pki.write_public(d / "mosquitto.conf", mosquitto_conf(self.spec, target))
        key, cert = self.ca()
        crl = pki.crl(key, cert, sorted(self.spec.revoked))
        pki.write_public(d / "crl.pem", crl.public_bytes(serialization.Encoding.PEM))


def provision(out: str | Path, spec: ProvisionSpec, *, archive: bool = False) -> Path:
    """Create a fleet's CA, broker, coordinator and device material in ``out``; returns it.

    Raises:
        ConfigError: ``out`` already holds a fleet (its CA is never overwritten).
    """
    root = Path(out)
    if (root / STATE_FILE).exists() or (root / "ca" / "ca.key").exists():
        raise ConfigError(
            f"--out {root} already holds a fleet; add devices with `provision add` "
            "(a new CA would lock out every device already deployed)"
        )
    ids = device_ids(spec.devices)
    fleet = _Fleet(root, ProvisionSpec(**{**asdict(spec), "devices": (), "devices_issued": {}}))
    ca_dir = pki.private_dir(root / "ca")
    ca_key, ca_cert = pki.make_ca(spec.federation)
    pki.write_secret(ca_dir / "ca.key", pki.pem_private(ca_key))
    pki.write_public(ca_dir / "ca.crt", pki.pem_cert(ca_cert))
    _broker_files(fleet, ca_key, ca_cert)
    _coordinator_kit(fleet, ca_key, ca_cert)
    fleet.save()
    add_devices(root, ids, archive=archive)
    return root


def _broker_files(fleet: _Fleet, ca_key: Any, ca_cert: x509.Certificate) -> None:
    d = fleet.broker_dir
    d.mkdir(parents=True, exist_ok=True)
    spec = fleet.spec
    key, cert = pki.issue(
        ca_key,
        ca_cert,
        spec.hostnames[0],
        spec.federation,
        days=spec.days,
        server_names=spec.hostnames,
    )
    pki.write_secret(d / "server.key", pki.pem_private(key))
    if spec.broker_user:
        try:
            shutil.chown(d / "server.key", user=spec.broker_user)
        except (LookupError, PermissionError) as exc:
            raise ConfigError(
                f"--broker-user {spec.broker_user}: cannot own the key: {exc}"
            ) from exc
    pki.write_public(d / "server.crt", pki.pem_cert(cert))
    pki.write_public(d / "ca.crt", pki.pem_cert(ca_cert))
    fleet.write_broker_config()


def _coordinator_kit(fleet: _Fleet, ca_key: Any, ca_cert: x509.Certificate) -> None:
    d = pki.private_dir(fleet.out / COORDINATOR_ID)
    pki.private_dir(d / "verify")
    key, cert = pki.issue(
        ca_key, ca_cert, COORDINATOR_ID, fleet.spec.federation, days=fleet.spec.days
    )
    pki.write_secret(d / "coordinator.key", pki.pem_private(key))
    pki.write_public(d / "coordinator.crt", pki.pem_cert(cert))
    pki.write_public(d / "ca.crt", pki.pem_cert(ca_cert))
    signing = ed25519.Ed25519PrivateKey.generate()
    pki.write_secret(d / "signing.key", pki.pem_private(signing))
    pki.write_public(d / "signing.pub", pki.pem_public(signing.public_key()))
    write_kit(_kit(fleet.spec, d, "coordinator", COORDINATOR_ID, "coordinator"))


def _kit(spec: ProvisionSpec, d: Path, role: Any, ident: str, stem: str) -> Kit:
    return Kit(
        path=d,
        role=role,
        id=ident,
        federation=spec.federation,
        broker=spec.broker,
        ca=d / "ca.crt",
        cert=d / f"{stem}.crt",
        key=d / f"{stem}.key",
        signing_key=d / "signing.key",
        verify_keys=d / "verify",
    )


def add_devices(
    out: str | Path,
    ids: Sequence[str] = (),
    *,
    count: int = 0,
    prefix: str = "device-",
    archive: bool = False,
) -> list[Path]:
    """Issue a certificate, signing key and kit for each new device; returns the kit paths.

    ``count`` more devices are named ``{prefix}NNN`` with numbers no device used before.

    Raises:
        ConfigError: an id already holds a valid certificate (revoke it first).
    """
    fleet = _Fleet.open(Path(out))
    used = {*fleet.spec.devices_issued, *fleet.spec.revoked.values()}
    ids = device_ids(ids, count, prefix, skip=used)
    taken = sorted(set(ids) & set(fleet.spec.devices_issued))
    if taken:
        raise ConfigError(f"device(s) {taken} already provisioned; revoke them first")
    ca_key, ca_cert = fleet.ca()
    issued = dict(fleet.spec.devices_issued)
    kits = []
    for device in ids:
        kit_dir, serial = _device_kit(fleet, ca_key, ca_cert, device)
        issued[device] = serial
        fleet.spec = _replace(fleet.spec, devices_issued=issued)
        fleet.save()  # after each device: an interrupted batch keeps what it issued
        if archive:
            _archive(kit_dir)
        kits.append(kit_dir)
    return kits


def _replace(spec: ProvisionSpec, **changes: Any) -> ProvisionSpec:
    data = {**asdict(spec), **changes}
    data["devices"] = tuple(sorted(data["devices_issued"]))
    data["hostnames"] = tuple(data["hostnames"])
    return ProvisionSpec(**data)


def _device_kit(
    fleet: _Fleet, ca_key: Any, ca_cert: x509.Certificate, device: str
) -> tuple[Path, str]:
    d = fleet.out / "devices" / device
    if d.exists():
        shutil.rmtree(d)
    pki.private_dir(d.parent)
    pki.private_dir(d)
    pki.private_dir(d / "verify")
    key, cert = pki.issue(ca_key, ca_cert, device, fleet.spec.federation, days=fleet.spec.days)
    pki.write_secret(d / "device.key", pki.pem_private(key))
    pki.write_public(d / "device.crt", pki.pem_cert(cert))
    pki.write_public(d / "ca.crt", pki.pem_cert(ca_cert))
    signing = ed25519.Ed25519PrivateKey.generate()
    pki.write_secret(d / "signing.key", pki.pem_private(signing))
    coordinator_pub = fleet.out / COORDINATOR_ID / "signing.pub"
    shutil.copyfile(coordinator_pub, d / "verify" / f"{COORDINATOR_ID}.pub")
    pki.write_public(
        fleet.out / COORDINATOR_ID / "verify" / f"{device}.pub",
        pki.pem_public(signing.public_key()),
    )
    write_kit(_kit(fleet.spec, d, "device", device, "device"))
    return d, format(cert.serial_number, "x")


def _archive(kit_dir: Path) -> Path:
    """``ID.tar.gz`` beside the kit (mode 0600: it holds the device's private keys)."""
    target = kit_dir.parent / f"{kit_dir.name}.tar.gz"
    target.unlink(missing_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
        tar.add(kit_dir, arcname=kit_dir.name)
    return target


def revoke_devices(out: str | Path, ids: Sequence[str]) -> Path:
    """Revoke devices: the CRL and the coordinator's revocation list rewritten, their kits and
    public keys deleted.

    Returns the broker directory, whose ``crl.pem`` must reach the broker, which must then
    reload (SIGHUP) or restart: Mosquitto reads the CRL only then. A coordinator running with
    this fleet's coordinator kit drops the devices by itself (``OUT/coordinator/revoked``).

    Raises:
        ConfigError: an id that holds no valid certificate.
    """
    fleet = _Fleet.open(Path(out))
    unknown = sorted(set(ids) - set(fleet.spec.devices_issued))
    if unknown:
        raise ConfigError(
            f"cannot revoke {unknown}: not provisioned (known: {sorted(fleet.spec.devices_issued)})"
        )
    issued = dict(fleet.spec.devices_issued)
    revoked = dict(fleet.spec.revoked)
    for device in ids:
        revoked[issued.pop(device)] = device
        shutil.rmtree(fleet.out / "devices" / device, ignore_errors=True)
        (fleet.out / "devices" / f"{device}.tar.gz").unlink(missing_ok=True)
        (fleet.out / COORDINATOR_ID / "verify" / f"{device}.pub").unlink(missing_ok=True)
    fleet.spec = _replace(fleet.spec, devices_issued=issued, revoked=revoked)
    fleet.save()
    fleet.write_broker_config()
    return fleet.broker_dir


def summary(out: str | Path) -> str:
    """What ``provision init`` wrote and the commands that use it."""
    fleet = _Fleet.open(Path(out))
    root, spec = fleet.out, fleet.spec
    first = spec.devices[0] if spec.devices else "ID"
    return "\n".join(
        [
            f"fleet {spec.federation!r} in {root}: CA, broker, coordinator and "
            f"{len(spec.devices)} device kit(s); keep ca/ca.key offline",
            f"broker:      copy {root}/broker to the broker host, then "
            f"`mosquitto -c {root}/broker/mosquitto.conf` (listens on {spec.port}, mTLS, ACL)",
            *(
                [
                    f"websockets: {spec.websocket_url} (mTLS too): edge-agent --kit {first} "
                    f"--broker {spec.websocket_url}"
                ]
                if spec.ws_port
                else []
            ),
            f"coordinator: coordinator serve --kit {root}/{COORDINATOR_ID} --algorithm fedavg",
            f"device:      copy {root}/devices/{first} to the device, then "
            f"edge-agent --kit {first}",
            f"later:       coordinator provision add --out {root} NEW_ID | "
            f"coordinator provision revoke --out {root} {first}",
        ]
    )
