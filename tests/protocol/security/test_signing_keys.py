"""``protocol.security.keys.load_signing``: a kit's keys verify its peers and its own id (the
processes that share a participant's identity, a coordinator's ingest workers), and a peer's
key never verifies as anyone else, the coordinator above all."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from coordinator.ops.provision import ProvisionSpec, provision
from protocol.contract.codec import Envelope, encode
from protocol.contract.messages import Status
from protocol.contract.topics import COORDINATOR_ID
from protocol.errors import ConfigError, SignatureError
from protocol.security.credentials import load_credentials
from protocol.security.keys import SigningKeys, load_signer, load_signing


@pytest.fixture
def fleet(tmp_path: Path) -> Path:
    pytest.importorskip("cryptography")
    out = tmp_path / "fleet"
    provision(out, ProvisionSpec(federation="lab", devices=("dev-1", "dev-2")))
    return out


def kit_keys(kit: Path, key_id: str) -> SigningKeys:
    keys = load_signing(load_credentials(kit=kit, env={}), key_id)
    assert keys is not None
    return keys


def signed(key_file: Path, key_id: str) -> bytes:
    """A status frame that says it comes from ``key_id``, signed with ``key_file``."""
    env = Envelope(body=Status(state="online"), sender=key_id, federation="lab")
    return load_signer(key_file, key_id).sign(encode(env))  # type: ignore[no-any-return]


def test_the_coordinator_kit_verifies_its_workers_frames(fleet: Path) -> None:
    # Prepare: the coordinator kit as provisioned, whose verify/ holds the devices' keys only
    kit = fleet / COORDINATOR_ID
    assert sorted(p.name for p in (kit / "verify").iterdir()) == ["dev-1.pub", "dev-2.pub"]
    verifier = kit_keys(kit, COORDINATOR_ID).verifier()
    # Execute: a frame of another process signing with the kit's key (an ingest worker)
    env = verifier.verify(signed(kit / "signing.key", COORDINATOR_ID))
    # Assert
    assert env.sender == COORDINATOR_ID
    assert verifier.verify(signed(fleet / "devices" / "dev-1" / "signing.key", "dev-1"))


def test_a_device_key_never_verifies_as_the_coordinator(fleet: Path) -> None:
    # Prepare: a device's key, planted in the coordinator kit's verify/ under its id
    kit, device_key = fleet / COORDINATOR_ID, fleet / "devices" / "dev-1" / "signing.key"
    shutil.copyfile(
        fleet / COORDINATOR_ID / "verify" / "dev-1.pub", kit / "verify" / "coordinator.pub"
    )
    coordinator = kit_keys(kit, COORDINATOR_ID).verifier()
    device = kit_keys(fleet / "devices" / "dev-2", "dev-2").verifier()
    # Execute + Assert: the device's key speaking as the coordinator, to both sides
    for verifier in (coordinator, device):
        with pytest.raises(SignatureError, match="bad ed25519 signature for key 'coordinator'"):
            verifier.verify(signed(device_key, COORDINATOR_ID))
    # the coordinator's own key still verifies, to both sides
    for verifier in (coordinator, device):
        assert verifier.verify(signed(kit / "signing.key", COORDINATOR_ID))


def test_a_device_trusts_its_own_key_for_its_own_id_only(fleet: Path) -> None:
    own_key = fleet / "devices" / "dev-2" / "signing.key"
    verifier = kit_keys(fleet / "devices" / "dev-2", "dev-2").verifier()
    assert verifier.verify(signed(own_key, "dev-2")).sender == "dev-2"
    with pytest.raises(SignatureError, match="unknown key id 'dev-1'"):
        verifier.verify(signed(own_key, "dev-1"))


def test_a_verify_directory_without_a_peer_is_refused(fleet: Path) -> None:
    # the kit's own key does not count: with no peer's key, nobody could be verified
    kit = fleet / COORDINATOR_ID
    for pub in (kit / "verify").iterdir():
        pub.unlink()
    with pytest.raises(ConfigError, match=r"holds no peer's ID\.pub file"):
        kit_keys(kit, COORDINATOR_ID)
