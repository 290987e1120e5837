"""Every message kind and payload encoding survives encode -> decode -> encode byte for byte."""

from __future__ import annotations

import os
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msg_strategies import BUILDERS, envelopes, payloads

from protocol.contract.codec import Envelope, decode, encode
from protocol.contract.messages import MESSAGE_TYPES, Ack, Reply
from protocol.contract.payloads import PAYLOAD_TYPES, TensorMap

# EDGEFL_HYPOTHESIS_EXAMPLES=2000 for a long local campaign; CI keeps the default
FAST = settings(
    max_examples=int(os.environ.get("EDGEFL_HYPOTHESIS_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _same(a: Any, b: Any) -> bool:
    """Structural equality that compares numpy arrays by dtype, shape and values."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and np.array_equal(a, b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(
            _same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__
        )
    return bool(a == b) and type(a) is type(b)


def test_strategies_cover_every_message_kind() -> None:
    assert set(BUILDERS) == set(MESSAGE_TYPES)


@pytest.mark.parametrize("kind", sorted(MESSAGE_TYPES))
@FAST
@given(data=st.data())
def test_encode_decode_encode_is_byte_identical(kind: str, data: st.DataObject) -> None:
    # Prepare
    env = data.draw(envelopes(BUILDERS[kind]))
    # Execute
    wire = encode(env)
    back = decode(wire)
    # Assert
    assert encode(back) == wire
    assert back.kind == kind
    assert (back.sender, back.federation, back.round, back.msg_id, back.ts) == (
        env.sender,
        env.federation,
        env.round,
        env.msg_id,
        env.ts,
    )


@FAST
@given(env=envelopes(BUILDERS["reply"]))
def test_exact_payloads_decode_to_equal_objects(env: Envelope) -> None:
    body = env.body
    assert isinstance(body, Reply)
    exact = {k: p for k, p in body.payloads.items() if getattr(p, "encoding", "raw") == "raw"}
    back = decode(
        encode(
            Envelope(
                body=Reply(
                    task_id=body.task_id,
                    round=body.round,
                    phase=body.phase,
                    num_samples=body.num_samples,
                    payloads=exact,
                    metrics=body.metrics,
                ),
                sender=env.sender,
                ts=env.ts,
                msg_id=env.msg_id,
            )
        )
    )
    assert _same(back.body.payloads, exact)  # type: ignore[union-attr]
    assert back.body.metrics == body.metrics  # type: ignore[union-attr]


@FAST
@given(payload=payloads)
def test_every_payload_type_round_trips_in_a_reply(payload: Any) -> None:
    env = Envelope(
        body=Reply(task_id="t", round=1, phase="train", num_samples=3, payloads={"p": payload}),
        sender="dev-1",
        ts=1.0,
        msg_id="m",
    )
    back = decode(encode(env)).body.payloads["p"]  # type: ignore[union-attr]
    assert type(back) is type(payload) and type(back).KIND in PAYLOAD_TYPES
    assert back.encoding == payload.encoding
    for name in ("vectors", "features", "logits", "images", "class_ids", "counts"):
        if hasattr(payload, name):  # optional arrays (ivpairs' class_ids) may be absent
            sent, got = getattr(payload, name), getattr(back, name)
            assert (got is None) == (sent is None)
            assert sent is None or got.shape == sent.shape


def test_float_fields_given_as_int_encode_canonically() -> None:
    # A float field built from an int still travels as a float64, so re-encoding is stable.
    env = Envelope(
        body=Reply(task_id="t", round=0, phase="p", num_samples=1, metrics={"acc": 1}),
        sender="s",
        ts=5,
        msg_id="m",
    )  # type: ignore[arg-type]
    wire = encode(env)
    assert encode(decode(wire)) == wire
    assert isinstance(decode(wire).body.metrics["acc"], float)  # type: ignore[union-attr]


def test_fields_equal_to_their_defaults_are_left_out_and_restored() -> None:
    plain = encode(Envelope(body=Ack(ref_id="r1", task_id="t1"), sender="c"))
    assert msgpack.unpackb(plain)["b"] == {"ref_id": "r1", "task_id": "t1"}
    assert decode(plain).body == Ack(ref_id="r1", task_id="t1", accepted=True, reason="")
    rejected = Ack(ref_id="r1", accepted=False, reason="stale")
    body = msgpack.unpackb(encode(Envelope(body=rejected, sender="c")))["b"]
    assert body == {"ref_id": "r1", "accepted": False, "reason": "stale"}  # task_id "" left out
    reply = Reply(task_id="t", round=1, phase="train", num_samples=3)
    assert set(msgpack.unpackb(encode(Envelope(body=reply, sender="a")))["b"]) == {
        "task_id",
        "round",
        "phase",
        "num_samples",
    }
    w = np.ones(4, np.float32)
    raw = TensorMap({"w": w}).to_wire()
    assert "encoding" not in raw
    assert TensorMap({"w": w}, encoding="f16").to_wire()["encoding"] == "f16"


def test_class_names_travel_and_a_bad_list_is_refused_naming_the_field() -> None:
    from protocol.contract.messages import Capabilities, CoordinatorState, InputSpec, Register
    from protocol.errors import ValidationError

    def register(names: list[str]) -> Register:
        return Register(
            device_id="d",
            arch="mlp_s",
            num_params=1,
            capabilities=Capabilities(device="cpu"),
            input_spec=InputSpec(1, 8, 8),
            num_classes=3,
            class_counts={"2": 4},
            algorithm="fedproto",
            class_names=names,
        )

    env = Envelope(body=register(["cat", "dog", "eel"]), sender="d")
    assert decode(encode(env)).body == env.body
    with pytest.raises(ValidationError, match="class_names"):
        register(["cat", "dog"])  # not one per class
    with pytest.raises(ValidationError, match="unique"):
        register(["cat", "dog", "cat"])
    with pytest.raises(ValidationError, match=r"class_names\[1\]"):
        register(["cat", "", "eel"])
    with pytest.raises(ValidationError, match="unique"):
        CoordinatorState(
            state="running", run_id="r", algorithm="a", round=0, total_rounds=1, classes=["a", "a"]
        )
