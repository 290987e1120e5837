"""Signed frames: tampering, replay, unsigned, wrong key, another sender, stale timestamps."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgpack
import numpy as np
import pytest

from protocol.contract.chunking import ChunkPolicy
from protocol.contract.codec import Envelope, encode
from protocol.contract.messages import Ack, Reply, Status
from protocol.contract.payloads import TensorMap
from protocol.contract.topics import Topics
from protocol.errors import ConfigError, SignatureError
from protocol.security.signing import HmacSigner, Signer, Verifier, VerifyKey
from protocol.transport.base import MemoryBroker, MemoryTransport
from protocol.transport.endpoint import Endpoint

T = Topics("fed")
NOW = 1_700_000_000.0
DEV_KEY, OTHER_KEY = b"device-1-secret-key", b"device-2-secret-key"


def _hmac() -> tuple[Signer, Signer, Signer]:
    """dev1, dev2, and an impostor holding another key under dev1's id."""
    return (
        HmacSigner("dev1", DEV_KEY),
        HmacSigner("dev2", OTHER_KEY),
        HmacSigner("dev1", OTHER_KEY),
    )


def _ed25519() -> tuple[Signer, Signer, Signer]:
    pytest.importorskip("cryptography", reason="Ed25519 needs the cryptography package")
    from protocol.security.signing import Ed25519Signer

    return tuple(Ed25519Signer.generate(k) for k in ("dev1", "dev2", "dev1"))  # type: ignore[return-value]


Scheme = Callable[[], tuple[Signer, Signer, Signer]]


SCHEMES = [pytest.param(_hmac, id="hmac"), pytest.param(_ed25519, id="ed25519")]


def _verifier(*signers: Signer, window: float = 300.0) -> Verifier:
    keys: dict[str, VerifyKey] = {s.key_id: s.verify_key() for s in signers}  # type: ignore[attr-defined]
    return Verifier(keys, window=window, clock=lambda: NOW)


def _frame(sender: str = "dev1", ts: float = NOW, msg_id: str = "m1") -> bytes:
    return encode(
        Envelope(body=Ack(ref_id="r"), sender=sender, federation="fed", ts=ts, msg_id=msg_id)
    )


@pytest.mark.parametrize("scheme", SCHEMES)
def test_valid_signature_opens(scheme: Scheme) -> None:
    dev1, dev2, _ = scheme()
    env = _verifier(dev1, dev2).verify(dev1.sign(_frame()))
    assert env.sender == "dev1" and env.body == Ack(ref_id="r")


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("where", ["sm", "g"])
def test_tampered_frame_is_rejected(scheme: Scheme, where: str) -> None:
    dev1, dev2, _ = scheme()
    signed = msgpack.unpackb(dev1.sign(_frame()))
    blob = bytearray(signed[where])
    blob[len(blob) // 2] ^= 0x01
    signed[where] = bytes(blob)
    with pytest.raises(SignatureError, match=r"bad .* signature for key 'dev1'"):
        _verifier(dev1, dev2).verify(msgpack.packb(signed))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_replay_is_rejected(scheme: Scheme) -> None:
    dev1, _, _ = scheme()
    verifier, signed = _verifier(dev1), dev1.sign(_frame())
    verifier.verify(signed)
    with pytest.raises(SignatureError, match="replayed ack m1 from dev1"):
        verifier.verify(signed)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_wrong_key_is_rejected(scheme: Scheme) -> None:
    dev1, dev2, impostor = scheme()
    with pytest.raises(SignatureError, match="bad"):
        _verifier(dev1, dev2).verify(impostor.sign(_frame()))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_device_cannot_sign_for_another(scheme: Scheme) -> None:
    dev1, dev2, _ = scheme()
    with pytest.raises(SignatureError, match="key 'dev2' cannot sign for sender 'dev1'"):
        _verifier(dev1, dev2).verify(dev2.sign(_frame(sender="dev1")))


def test_unknown_key_id_is_rejected() -> None:
    dev1, dev2, _ = _hmac()
    with pytest.raises(SignatureError, match="unknown key id 'dev2'"):
        _verifier(dev1).verify(dev2.sign(_frame(sender="dev2")))


@pytest.mark.parametrize("skew", [-301.0, 301.0])
def test_timestamp_outside_the_window_is_rejected(skew: float) -> None:
    dev1, _, _ = _hmac()
    with pytest.raises(SignatureError, match="outside the"):
        _verifier(dev1).verify(dev1.sign(_frame(ts=NOW + skew)))


def test_unsigned_frame_is_rejected_by_verify() -> None:
    dev1, _, _ = _hmac()
    with pytest.raises(SignatureError, match="unsigned 'ack' frame from 'dev1'"):
        _verifier(dev1).verify(_frame())


def test_replay_cache_is_bounded_and_forgets_only_expired_entries() -> None:
    dev1, _, _ = _hmac()
    now = [NOW]
    verifier = Verifier({"dev1": dev1.verify_key()}, window=10, clock=lambda: now[0])  # type: ignore[attr-defined]
    verifier.verify(dev1.sign(_frame(ts=NOW, msg_id="a")))
    now[0] += 9  # still inside the window: only the replay cache can catch it
    with pytest.raises(SignatureError, match="replayed"):
        verifier.verify(dev1.sign(_frame(ts=NOW, msg_id="a")))
    now[0] += 100  # "a" can no longer pass the window check, so the cache may forget it
    verifier.verify(dev1.sign(_frame(ts=now[0], msg_id="b")))
    assert list(verifier._seen) == [("dev1", "b")]


def test_replay_cache_size_is_capped() -> None:
    dev1, _, _ = _hmac()
    verifier = Verifier({"dev1": dev1.verify_key()}, max_entries=3, clock=lambda: NOW)  # type: ignore[attr-defined]
    for i in range(10):
        verifier.verify(dev1.sign(_frame(msg_id=f"m{i}")))
    assert len(verifier._seen) <= 3


def test_short_hmac_keys_are_refused() -> None:
    with pytest.raises(ConfigError, match="at least 16"):
        HmacSigner("dev1", b"short")


# -- through endpoints ---------------------------------------------------------------------


def _endpoints(require: bool = True) -> tuple[Endpoint, Endpoint, MemoryTransport, list[Envelope]]:
    dev1, dev2, _ = _hmac()
    coord_signer = HmacSigner("coord", b"coordinator-secret")
    keys = {
        "dev1": dev1.verify_key(),
        "dev2": dev2.verify_key(),  # type: ignore[attr-defined]
        "coord": coord_signer.verify_key(),
    }
    broker = MemoryBroker()
    agent_t, coord_t, rogue_t = (MemoryTransport(broker, n) for n in ("dev1", "coord", "rogue"))
    for t in (agent_t, coord_t, rogue_t):
        t.connect()
    policy = ChunkPolicy(threshold=4096, sweep_interval=None)
    agent = Endpoint(
        agent_t,
        sender="dev1",
        federation="fed",
        signer=dev1,
        verifier=Verifier(keys),
        chunking=policy,
    )
    coord = Endpoint(
        coord_t,
        sender="coord",
        federation="fed",
        signer=coord_signer,
        verifier=Verifier(keys),
        require_signatures=require,
        unsigned_kinds=frozenset({"status"}),
        chunking=policy,
    )
    got: list[Envelope] = []
    coord.subscribe(f"{T.base}/dev/+/#", lambda e, t: got.append(e))
    return agent, coord, rogue_t, got


def test_endpoint_delivers_signed_chunked_messages() -> None:
    agent, coord, _, got = _endpoints()
    w = np.arange(20_000, dtype=np.float32)
    agent.send(
        T.up("dev1", "reply"),
        Reply(task_id="t", round=1, phase="p", num_samples=1, payloads={"w": TensorMap({"w": w})}),
    )
    assert len(got) == 1 and coord.rejected == {}
    assert np.array_equal(got[0].body.payloads["w"].tensors["w"], w)  # type: ignore[union-attr]


def test_endpoint_rejects_unsigned_replayed_and_forged_frames() -> None:
    agent, coord, rogue, got = _endpoints()
    # unsigned
    rogue.publish(T.up("dev1", "ack"), _frame(ts=time.time()))
    # replayed: capture a genuine signed frame and publish it again
    captured: list[bytes] = []
    rogue.subscribe(T.up("dev1", "ack"), lambda topic, data: captured.append(data))
    agent.send(T.up("dev1", "ack"), Ack(ref_id="x"))
    rogue.publish(T.up("dev1", "ack"), captured[-1])
    # forged: dev2's key speaking for dev1
    forged = HmacSigner("dev2", OTHER_KEY).sign(
        encode(Envelope(body=Ack(ref_id="y"), sender="dev1", federation="fed"))
    )
    rogue.publish(T.up("dev1", "ack"), forged)
    assert [e.body for e in got] == [Ack(ref_id="x")]
    assert coord.rejected == {"SignatureError": 3}


def test_status_may_stay_unsigned_for_the_last_will() -> None:
    _, coord, rogue, got = _endpoints()
    rogue.publish(T.status("dev1"), encode(Envelope(body=Status(state="offline"), sender="dev1")))
    assert [e.kind for e in got] == ["status"] and coord.rejected == {}


def test_signed_frame_without_a_verifier_is_rejected() -> None:
    broker = MemoryBroker()
    a, b = MemoryTransport(broker, "a"), MemoryTransport(broker, "b")
    a.connect()
    b.connect()
    plain = Endpoint(b, sender="coord", federation="fed")
    plain.subscribe("#", lambda e, t: None)
    signer = HmacSigner("dev1", DEV_KEY)
    Endpoint(a, sender="dev1", federation="fed", signer=signer).send("x/y", Ack(ref_id="r"))
    assert plain.rejected == {"SignatureError": 1}


def test_signer_must_match_the_sender() -> None:
    broker = MemoryBroker()
    with pytest.raises(SignatureError, match="must equal the sender"):
        Endpoint(MemoryTransport(broker, "a"), sender="dev2", signer=HmacSigner("dev1", DEV_KEY))
