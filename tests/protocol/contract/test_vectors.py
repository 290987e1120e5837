"""The stored test vectors: JSON -> message -> exact bytes, and bytes -> the JSON's meaning."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest

from protocol.contract.arrays import ENCODINGS, decode_array
from protocol.contract.codec import Envelope, decode
from protocol.contract.messages import MESSAGE_TYPES
from protocol.contract.payloads import PAYLOAD_TYPES
from protocol.security.signing import HmacKey, Verifier, VerifyKey
from protocol.vectors.make_vectors import (
    VECTOR_DIR,
    array_from_json,
    build,
    envelope_to_json,
    rebuild,
)

NAMES = sorted(p.stem for p in VECTOR_DIR.glob("*.json"))


def _load(name: str) -> tuple[bytes, dict[str, Any]]:
    data = (VECTOR_DIR / f"{name}.msgpack").read_bytes()
    return data, json.loads((VECTOR_DIR / f"{name}.json").read_text())


def _b64(node: dict[str, str]) -> bytes:
    import base64

    return base64.b64decode(node["base64"])


def _open(data: bytes, desc: dict[str, Any]) -> Envelope:
    sig = desc.get("signature")
    if sig is None:
        return decode(data)
    key: VerifyKey
    if sig["algorithm"] == "ed25519":
        pytest.importorskip("cryptography")
        from protocol.security.signing import Ed25519VerifyKey

        key = Ed25519VerifyKey(_b64(sig["public_key"]))
    else:
        key = HmacKey(_b64(sig["key"]))
    ts = desc["frame"]["t"]
    return Verifier({sig["kid"]: key}, clock=lambda: ts).verify(data)


@pytest.mark.parametrize("name", NAMES)
def test_json_rebuilds_the_exact_bytes(name: str) -> None:
    data, desc = _load(name)
    if desc.get("signature", {}).get("algorithm") == "ed25519":
        pytest.importorskip("cryptography")
    assert rebuild(desc) == data


@pytest.mark.parametrize("name", NAMES)
def test_bytes_decode_to_what_the_json_says(name: str) -> None:
    data, desc = _load(name)
    if "array" in desc:
        arr = decode_array(msgpack.unpackb(data))
        expected = array_from_json(desc["array"])
        assert arr.dtype == expected.dtype and arr.tobytes() == expected.tobytes()
        return
    env = _open(data, desc)
    assert json.loads(json.dumps(envelope_to_json(env))) == desc["frame"]


def test_vectors_cover_every_kind_payload_and_encoding() -> None:
    kinds, payloads, encodings = set(), set(), set()
    for name in NAMES:
        _, desc = _load(name)
        if "array" in desc:
            encodings.add(desc["encoding"])
            continue
        kinds.add(desc["frame"]["k"])
        for p in desc["frame"]["b"].get("payloads", {}).values():
            payloads.add(p["t"])
            encodings.add(p.get("encoding", "raw"))  # omitted when it is the default
    assert kinds == set(MESSAGE_TYPES)
    assert payloads == set(PAYLOAD_TYPES)
    assert encodings == set(ENCODINGS)
    assert {"signed_hmac_ack", "signed_ed25519_ack"} <= set(NAMES)


def test_stored_vectors_match_the_generator() -> None:
    # Regenerate with `python -m protocol.vectors.make_vectors` after a deliberate change.
    for name, (data, desc) in build().items():
        stored, stored_desc = _load(name)
        assert stored == data, name
        assert stored_desc == json.loads(json.dumps(desc)), name


def test_vector_directory_ships_with_the_package() -> None:
    assert Path(VECTOR_DIR).name == "vectors" and Path(VECTOR_DIR).parent.name == "protocol"
