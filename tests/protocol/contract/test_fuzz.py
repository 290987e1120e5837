"""Fuzzed decoding: whatever arrives, the codec raises a ProtocolError or returns an envelope.

Random bytes, byte-level mutations of valid frames (flips, truncation, splices) and
structure-level mutations (any node of the frame replaced by any msgpack value) all go through
``decode``, the signed-frame verifier and a live Endpoint. Nothing else may escape: no
TypeError, no numpy error, no MemoryError from a declared size. The per-test timeout bounds
the time (a hang or a huge allocation would trip it).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msg_strategies import envelopes

from protocol.contract.chunking import ChunkPolicy
from protocol.contract.codec import Envelope, Limits, decode, encode
from protocol.errors import ProtocolError
from protocol.security.signing import HmacSigner, Verifier
from protocol.transport.base import MemoryBroker, MemoryTransport
from protocol.transport.endpoint import Endpoint

pytestmark = pytest.mark.timeout(120)
FUZZ = settings(
    max_examples=int(os.environ.get("EDGEFL_FUZZ_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
LIMITS = Limits(max_message=1 << 20, max_items=10_000)
SIGNER = HmacSigner("dev-1", b"0123456789abcdef")
VERIFIER = Verifier({"dev-1": SIGNER.verify_key()}, window=1e12)

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=16),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=10,
)


def _decode_or_protocol_error(data: bytes) -> Envelope | None:
    try:
        return decode(data, LIMITS)
    except ProtocolError:
        return None


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def _replace(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    obj[path[0]] = _replace(obj[path[0]], path[1:], value)
    return obj


@FUZZ
@given(data=st.binary(max_size=512))
def test_random_bytes(data: bytes) -> None:
    _decode_or_protocol_error(data)


@FUZZ
@given(env=envelopes(), data=st.data())
def test_byte_mutations_of_valid_frames(env: Envelope, data: st.DataObject) -> None:
    frame = bytearray(encode(env))
    op = data.draw(st.sampled_from(["flip", "truncate", "splice", "insert"]))
    pos = data.draw(st.integers(0, len(frame) - 1))
    if op == "flip":
        frame[pos] ^= data.draw(st.integers(1, 255))
    elif op == "truncate":
        del frame[pos:]
    elif op == "splice":
        frame[pos : pos + 4] = data.draw(st.binary(min_size=1, max_size=8))
    else:
        frame[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
    _decode_or_protocol_error(bytes(frame))


@FUZZ
@given(env=envelopes(), data=st.data())
def test_structure_mutations_of_valid_frames(env: Envelope, data: st.DataObject) -> None:
    frame = msgpack.unpackb(encode(env))
    path = data.draw(st.sampled_from(_paths(frame)[1:]))
    mutated = _replace(frame, path, data.draw(msgpack_values))
    try:
        packed = msgpack.packb(mutated, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):  # not representable in msgpack at all
        return
    _decode_or_protocol_error(packed)


@FUZZ
@given(env=envelopes(), data=st.data())
def test_signed_frames_mutated_never_escape(env: Envelope, data: st.DataObject) -> None:
    signed = bytearray(
        SIGNER.sign(encode(Envelope(body=env.body, sender="dev-1", ts=env.ts, msg_id=env.msg_id)))
    )
    pos = data.draw(st.integers(0, len(signed) - 1))
    signed[pos] ^= data.draw(st.integers(1, 255))
    with contextlib.suppress(ProtocolError):
        VERIFIER.verify(bytes(signed), LIMITS)


def test_declared_giant_sizes_are_rejected_without_allocating() -> None:
    # A map claiming 2**32 entries or a bin claiming 4 GiB costs nothing to send.
    for data in (b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff"):
        assert _decode_or_protocol_error(data) is None


def test_deep_nesting_is_rejected() -> None:
    data = b"\x91" * 100_000 + b"\xc0"
    assert _decode_or_protocol_error(data) is None


@settings(max_examples=100, deadline=None)
@given(data=st.binary(min_size=1, max_size=256) | st.builds(encode, envelopes()))
def test_endpoint_never_raises_into_the_transport(data: bytes) -> None:
    broker = MemoryBroker()
    sender, receiver = MemoryTransport(broker, "a"), MemoryTransport(broker, "b")
    sender.connect()
    receiver.connect()
    delivered: list[Envelope] = []
    endpoint = Endpoint(
        receiver, sender="coordinator", limits=LIMITS, chunking=ChunkPolicy(sweep_interval=None)
    )
    endpoint.subscribe("edgefl/#", lambda env, topic: delivered.append(env))
    sender.publish("edgefl/v1/default/dev/x/up/reply", data)
    # Delivered, rejected or consumed (chunks, chunk requests): every byte is accounted for.
    assert endpoint.traffic.total("rx") == len(data)
    assert len(delivered) + sum(endpoint.rejected.values()) <= 1
