"""The endpoint tells handlers which envelopes were verified (``Envelope.verified``, ``trusted``).

With signatures required, the last wills (``unsigned_kinds``) still arrive, but flagged as not
verified, so that a handler can treat them as presence hints only (``WIRE.md`` §7). And
``load_signing``: signing is on whenever keys are known, ``--no-signing`` turns it off.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from protocol.contract.codec import Envelope, encode
from protocol.contract.messages import Ack, Status
from protocol.contract.topics import Topics
from protocol.errors import ConfigError
from protocol.security.credentials import Credentials
from protocol.security.keys import load_signing
from protocol.security.signing import HmacSigner, Verifier
from protocol.transport.base import MemoryBroker, MemoryTransport
from protocol.transport.endpoint import Endpoint

T = Topics("fed")
DEV = HmacSigner("dev1", b"device-1-secret-key")


def _pair(require: bool) -> tuple[Endpoint, MemoryTransport, list[Envelope]]:
    broker = MemoryBroker()
    agent_t, coord_t, rogue_t = (MemoryTransport(broker, n) for n in ("dev1", "coord", "rogue"))
    for t in (agent_t, coord_t, rogue_t):
        t.connect()
    coord = Endpoint(
        coord_t,
        sender="coord",
        federation="fed",
        verifier=Verifier({"dev1": DEV.verify_key()}),
        require_signatures=require,
        unsigned_kinds=frozenset({"status"}),
    )
    got: list[Envelope] = []
    coord.subscribe(f"{T.base}/dev/+/#", lambda e, t: got.append(e))
    agent = Endpoint(agent_t, sender="dev1", federation="fed", signer=DEV)
    agent.send(T.status("dev1"), Status(state="online"))
    return coord, rogue_t, got


def _will() -> bytes:
    return encode(Envelope(body=Status(state="offline"), sender="dev1", federation="fed"))


def test_signed_frames_arrive_verified_and_wills_unverified() -> None:
    # Prepare
    coord, rogue, got = _pair(require=True)
    # Execute: the broker publishes the agent's (unsigned) last will
    rogue.publish(T.status("dev1"), _will())
    # Assert
    assert [(e.body, e.verified, coord.trusted(e)) for e in got] == [
        (Status(state="online"), True, True),
        (Status(state="offline"), False, False),
    ]


def test_without_required_signatures_unsigned_frames_are_trusted() -> None:
    # Prepare
    coord, rogue, got = _pair(require=False)
    # Execute
    rogue.publish(T.up("dev1", "ack"), encode(Envelope(body=Ack(ref_id="r"), sender="dev1")))
    # Assert: still flagged as not verified, but nothing is required of it
    assert [(e.verified, coord.trusted(e)) for e in got] == [(True, True), (False, True)]


def test_only_exempt_kinds_pass_unsigned() -> None:
    # Prepare
    coord, rogue, got = _pair(require=True)
    # Execute: an unsigned ack is not a will
    rogue.publish(T.up("dev1", "ack"), encode(Envelope(body=Ack(ref_id="r"), sender="dev1")))
    # Assert
    assert [e.kind for e in got] == ["status"] and coord.rejected == {"SignatureError": 1}


# -- load_signing: on with keys, --no-signing, half a key set -----------------------------------


def _keys(tmp_path: Path) -> Credentials:
    pytest.importorskip("cryptography")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    own, peer = ed25519.Ed25519PrivateKey.generate(), ed25519.Ed25519PrivateKey.generate()
    (tmp_path / "verify").mkdir()
    (tmp_path / "signing.key").write_bytes(
        own.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    (tmp_path / "verify" / "coordinator.pub").write_bytes(
        peer.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    sources = {"signing_key": "kit /k", "verify_keys": "kit /k"}
    return Credentials(
        signing_key=tmp_path / "signing.key", verify_keys=tmp_path / "verify", sources=sources
    )


def test_signing_is_on_whenever_keys_are_known(tmp_path: Path) -> None:
    keys = load_signing(_keys(tmp_path), "dev1")
    assert keys is not None and keys.signer.key_id == "dev1"
    options = keys.endpoint_options(frozenset({"coord_state"}))
    assert options["require_signatures"] and options["unsigned_kinds"] == {"coord_state"}
    assert sorted(keys.verify_keys) == ["coordinator", "dev1"]  # its peer's and its own
    assert load_signing(Credentials(), "dev1") is None  # no keys: unsigned, the default


def test_no_signing_turns_it_off_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="edgefl.credentials"):
        assert load_signing(_keys(tmp_path), "dev1", enabled=False) is None
    assert "--no-signing: frames are neither signed nor verified" in caplog.text


def test_half_a_key_set_is_a_config_error(tmp_path: Path) -> None:
    creds = dataclasses.replace(_keys(tmp_path), verify_keys=None)
    with pytest.raises(ConfigError, match="signing_key from kit /k but no verify_keys"):
        load_signing(creds, "dev1")
