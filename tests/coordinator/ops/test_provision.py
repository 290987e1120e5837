"""``coordinator provision``: certificates, keys, kits, broker config and ACL (no broker here;
``test_provision_broker.py`` checks the same files on a real Mosquitto)."""

from __future__ import annotations

import json
import stat
import tarfile
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from coordinator.cli import main
from coordinator.ops.provision import (
    ProvisionSpec,
    acl_text,
    add_devices,
    device_ids,
    provision,
    revoke_devices,
)
from protocol.errors import ConfigError
from protocol.security.keys import load_signer, load_verify_keys
from protocol.security.kit import read_kit

DEVICES = ("cam-1", "cam-2")


@pytest.fixture
def fleet(tmp_path: Path) -> Path:
    out = tmp_path / "fleet"
    provision(
        out,
        ProvisionSpec(federation="lab", devices=DEVICES, hostnames=("broker.lan", "10.0.0.5")),
        archive=True,
    )
    return out


def cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def cn(c: x509.Certificate) -> str:
    return str(c.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_every_certificate_chains_to_the_ca_with_its_name(fleet: Path) -> None:
    ca = cert(fleet / "ca" / "ca.crt")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    leaves = {
        "cam-1": fleet / "devices" / "cam-1" / "device.crt",
        "cam-2": fleet / "devices" / "cam-2" / "device.crt",
        "coordinator": fleet / "coordinator" / "coordinator.crt",
        "broker.lan": fleet / "broker" / "server.crt",
    }
    for name, path in leaves.items():
        leaf = cert(path)
        leaf.verify_directly_issued_by(ca)  # raises if the signature or issuer is wrong
        assert cn(leaf) == name
        assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    usage = cert(leaves["cam-1"]).extensions.get_extension_for_class(x509.ExtendedKeyUsage)
    assert list(usage.value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    server = cert(leaves["broker.lan"])
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["broker.lan"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]


def test_private_keys_are_0600_and_kits_0700(fleet: Path) -> None:
    keys = [*fleet.rglob("*.key"), *fleet.rglob("*.tar.gz")]
    assert len(keys) == 1 + 1 + 2 + 2 * 2 + 2  # CA, server, coordinator TLS+signing, devices
    assert {p.name: mode(p) for p in keys} == {p.name: 0o600 for p in keys}
    for d in (fleet / "ca", fleet / "coordinator", *(fleet / "devices").glob("cam-?")):
        assert mode(d) == 0o700, d
    assert "PRIVATE" not in (fleet / "fleet.json").read_text()


def test_a_device_kit_holds_its_own_material_only(fleet: Path) -> None:
    kit_dir = fleet / "devices" / "cam-1"
    files = sorted(str(p.relative_to(kit_dir)) for p in kit_dir.rglob("*") if p.is_file())
    assert files == [
        "ca.crt",
        "device.crt",
        "device.key",
        "kit.json",
        "signing.key",
        "verify/coordinator.pub",
    ]
    kit = read_kit(kit_dir)
    assert (kit.role, kit.id, kit.federation, kit.broker) == (
        "device",
        "cam-1",
        "lab",
        "broker.lan:8883",
    )
    with tarfile.open(fleet / "devices" / "cam-1.tar.gz") as tar:
        member = tar.getmember("cam-1/device.key")
        assert member.mode & 0o077 == 0
        assert sorted(tar.getnames()) == sorted(
            ["cam-1", "cam-1/verify", *(f"cam-1/{f}" for f in files)]
        )


def test_signing_keys_pair_up_between_kits(fleet: Path) -> None:
    device = load_signer(fleet / "devices" / "cam-2" / "signing.key", "cam-2")
    coordinator = load_signer(fleet / "coordinator" / "signing.key", "coordinator")
    at_coordinator = load_verify_keys(fleet / "coordinator" / "verify")
    at_device = load_verify_keys(fleet / "devices" / "cam-2" / "verify")
    assert sorted(at_coordinator) == ["cam-1", "cam-2"] and sorted(at_device) == ["coordinator"]
    assert at_coordinator["cam-2"].verify(b"m", device.signature(b"m"))
    assert not at_coordinator["cam-1"].verify(b"m", device.signature(b"m"))
    assert at_device["coordinator"].verify(b"m", coordinator.signature(b"m"))


def test_acl_confines_devices_to_their_own_topics(fleet: Path) -> None:
    acl = (fleet / "broker" / "acl").read_text()
    rules = [line for line in acl.splitlines() if line and not line.startswith("#")]
    assert rules == [
        "pattern read edgefl/v1/lab/dev/%u/down/#",
        "pattern write edgefl/v1/lab/dev/%u/up/#",
        "pattern write edgefl/v1/lab/dev/%u/status",
        "pattern write edgefl/v1/lab/dev/%u/progress",
        "pattern read edgefl/v1/lab/bcast/#",
        "pattern read edgefl/v1/lab/round",
        "pattern read edgefl/v1/lab/coord/state",
        "user coordinator",
        "topic readwrite edgefl/v1/lab/#",
    ]
    assert acl == acl_text("lab")


def test_mosquitto_conf_requires_certificates(fleet: Path) -> None:
    conf = (fleet / "broker" / "mosquitto.conf").read_text().splitlines()
    broker = (fleet / "broker").resolve()
    for line in (
        "listener 8883",
        f"cafile {broker}/ca.crt",
        f"certfile {broker}/server.crt",
        f"keyfile {broker}/server.key",
        "require_certificate true",
        "use_identity_as_username true",
        "allow_anonymous false",
        f"acl_file {broker}/acl",
        f"crlfile {broker}/crl.pem",  # named from the start: a reload takes a new one
    ):
        assert line in conf
    ca = cert(fleet / "ca" / "ca.crt")
    crl = x509.load_pem_x509_crl((fleet / "broker" / "crl.pem").read_bytes())
    assert len(crl) == 0 and crl.is_signature_valid(ca.public_key())  # type: ignore[arg-type]


def test_broker_dir_names_where_the_files_will_be(tmp_path: Path) -> None:
    provision(tmp_path / "f", ProvisionSpec(broker_dir="/etc/mosquitto/edgefl", port=9883))
    conf = (tmp_path / "f" / "broker" / "mosquitto.conf").read_text()
    assert "keyfile /etc/mosquitto/edgefl/server.key" in conf and "listener 9883\n" in conf


def test_ws_port_adds_a_websockets_listener_with_the_same_mutual_tls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, broker = tmp_path / "f", (tmp_path / "f" / "broker").resolve()
    argv = ["provision", "init", "--out", str(out), "--ws-port", "8884", "--listen", "10.0.0.5"]
    assert main([*argv, "--devices", "cam-1"]) == 0
    conf = (out / "broker" / "mosquitto.conf").read_text()
    tls, _, websockets = conf.partition("listener 8884 10.0.0.5\n")
    assert "listener 8883 10.0.0.5\n" in tls and "protocol websockets" not in tls
    for line in (  # each listener carries its TLS settings: Mosquitto keeps them per listener
        f"cafile {broker}/ca.crt",
        f"certfile {broker}/server.crt",
        f"keyfile {broker}/server.key",
        "require_certificate true",
        "use_identity_as_username true",
        f"crlfile {broker}/crl.pem",
    ):
        assert f"\n{line}\n" in tls and f"{line}\n" in websockets, line
    assert websockets.splitlines()[-3] == "protocol websockets"  # then the global settings
    assert conf.count("acl_file ") == 1 and "allow_anonymous false" in conf
    assert "--broker wss://localhost:8884/mqtt" in capsys.readouterr().out
    assert read_kit(out / "devices" / "cam-1").broker == "localhost:8883"  # TLS stays the default
    # without --ws-port: no WebSockets listener (a Mosquitto built without them would not start)
    provision(tmp_path / "g", ProvisionSpec())
    assert "protocol websockets" not in (tmp_path / "g" / "broker" / "mosquitto.conf").read_text()
    with pytest.raises(ConfigError, match=r"--ws-port: expected 1\.\.65535 other than --port 8883"):
        ProvisionSpec(ws_port=8883)


def test_revoke_writes_a_crl_and_removes_the_device(fleet: Path) -> None:
    serial = cert(fleet / "devices" / "cam-1" / "device.crt").serial_number
    revoke_devices(fleet, ["cam-1"])
    ca = cert(fleet / "ca" / "ca.crt")
    crl = x509.load_pem_x509_crl((fleet / "broker" / "crl.pem").read_bytes())
    assert crl.is_signature_valid(ca.public_key())  # type: ignore[arg-type]
    assert [r.serial_number for r in crl] == [serial]
    assert not (fleet / "devices" / "cam-1").exists()
    assert not (fleet / "devices" / "cam-1.tar.gz").exists()
    assert sorted(load_verify_keys(fleet / "coordinator" / "verify")) == ["cam-2"]
    state = json.loads((fleet / "fleet.json").read_text())
    assert state["devices"] == ["cam-2"] and list(state["revoked"].values()) == ["cam-1"]


def test_add_issues_a_new_device_and_refuses_a_known_one(fleet: Path) -> None:
    (kit,) = add_devices(fleet, ["cam-3"])
    assert cn(cert(kit / "device.crt")) == "cam-3"
    assert "cam-3" in load_verify_keys(fleet / "coordinator" / "verify")
    with pytest.raises(ConfigError, match=r"already provisioned; revoke them first"):
        add_devices(fleet, ["cam-2"])
    revoke_devices(fleet, ["cam-2"])
    (again,) = add_devices(fleet, ["cam-2"])  # a replacement device gets a new certificate
    assert cn(cert(again / "device.crt")) == "cam-2"


def test_refusals(fleet: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="already holds a fleet"):
        provision(fleet, ProvisionSpec())
    with pytest.raises(ConfigError, match=r"cannot revoke \['ghost'\]: not provisioned"):
        revoke_devices(fleet, ["ghost"])
    with pytest.raises(ConfigError, match=r"no fleet\.json"):
        add_devices(tmp_path / "nowhere", ["x"])
    with pytest.raises(ConfigError, match="reserved for the coordinator"):
        device_ids(["coordinator"])
    with pytest.raises(ConfigError, match=r"given twice: \['a'\]"):
        device_ids(["a", "a"])
    with pytest.raises(ConfigError, match=r"device id: expected 1-64 characters"):
        device_ids(["a/b"])
    assert device_ids(["x"], count=2, prefix="d-") == ["x", "d-001", "d-002"]


def test_cli_init_add_revoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fleet"
    assert main(["provision", "init", "--out", str(out), "--count", "2", "--prefix", "d-"]) == 0
    assert "coordinator serve --kit" in capsys.readouterr().out
    assert read_kit(out / "devices" / "d-002").id == "d-002"
    assert main(["provision", "add", "--out", str(out), "extra", "--archive"]) == 0
    assert (out / "devices" / "extra.tar.gz").exists()
    assert main(["provision", "add", "--out", str(out), "--count", "1", "--prefix", "d-"]) == 0
    assert read_kit(out / "devices" / "d-003").id == "d-003"  # counting goes on after d-002
    assert main(["provision", "revoke", "--out", str(out), "d-001"]) == 0
    assert "reload mosquitto" in capsys.readouterr().out
    assert main(["provision", "revoke", "--out", str(out), "d-001"]) == 2
    assert "not provisioned" in capsys.readouterr().err
