"""The lean reply decoder accepts and rejects exactly what the typed walk does.

``protocol.contract.lean.decode_body`` may only return a body the typed walk (``Reply.from_wire``)
would
build equal; for anything else it returns ``None`` and the typed walk decides. These properties
check that over valid replies (every payload kind) and over corrupted ones: any node of a valid
reply replaced by any msgpack value, array bytes flipped to NaN/inf, dtypes and shapes changed.
Through ``codec.decode`` the two paths then accept the same frames, build equal envelopes and
raise the same error, word for word.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msg_strategies import BUILDERS, envelopes, feature_logit_sets, prototype_sets

from protocol.contract import lean
from protocol.contract.codec import Envelope, decode, decode_frame_map, encode, envelope_from_map
from protocol.contract.messages import Register, Reply, Status
from protocol.errors import ProtocolError

pytestmark = pytest.mark.timeout(300)
PROPS = settings(
    max_examples=int(os.environ.get("EDGEFL_FUZZ_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=16),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=8,
)


@st.composite
def lean_replies(draw: st.DrawFn) -> Reply:
    """Replies whose payloads are the kinds the lean path decodes itself."""
    payload = st.one_of(prototype_sets(), feature_logit_sets())
    return Reply(
        task_id=draw(st.text(min_size=1, max_size=12)),
        round=draw(st.integers(0, 2**31)),
        phase=draw(st.sampled_from(["train", "eval", "distill"])),
        num_samples=draw(st.integers(0, 10**6)),
        payloads=draw(st.dictionaries(st.sampled_from(["protos", "knowledge"]), payload)),
        metrics=draw(st.dictionaries(st.text(max_size=6), st.floats(-1e6, 1e6), max_size=3)),
    )


replies = st.one_of(lean_replies(), BUILDERS["reply"])


def wire_of(body: Any) -> bytes:
    """The canonical encoding: two bodies are equal when this is (arrays included)."""
    return msgpack.packb(body.to_wire(), use_bin_type=True)  # type: ignore[no-any-return]


# what envelope_from_map turns into a DecodeError around the typed walk
REJECTIONS = (ProtocolError, ValueError, TypeError, KeyError, OverflowError, IndexError)


def typed(obj: Any) -> Reply | Exception:
    try:
        return Reply.from_wire(obj, "reply")
    except REJECTIONS as exc:
        return exc


def assert_same(obj: Any) -> None:
    """The lean result is None or equal to the typed one; a typed rejection means None."""
    want = typed(copy.deepcopy(obj))
    got = lean.decode_body("reply", obj)
    if isinstance(want, Exception):
        assert got is None, f"lean accepted what the typed walk rejects: {want}"
    elif got is not None:
        assert type(got) is Reply
        assert wire_of(got) == wire_of(want)
        for key, payload in got.payloads.items():
            for name in ("class_ids", "vectors", "features", "logits", "counts", "sd"):
                mine, theirs = getattr(payload, name, None), getattr(want.payloads[key], name, None)
                if mine is not None:
                    assert mine.dtype == theirs.dtype and mine.shape == theirs.shape


def body_map(reply: Reply) -> dict[str, Any]:
    return msgpack.unpackb(wire_of(reply), raw=False)  # type: ignore[no-any-return]


def paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += paths(v, (*prefix, i))
    return out


def replace_at(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    obj[path[0]] = replace_at(obj[path[0]], path[1:], value)
    return obj


@PROPS
@given(reply=replies)
def test_valid_replies_decode_equal(reply: Reply) -> None:
    assert_same(body_map(reply))


@PROPS
@given(reply=lean_replies())
def test_lean_path_takes_the_replies_it_knows(reply: Reply) -> None:
    got = lean.decode_body("reply", body_map(reply))
    assert got is not None  # the accelerator is actually used for FedProto/Felo-shaped replies
    assert wire_of(got) == wire_of(reply)


@PROPS
@given(reply=replies, data=st.data())
def test_any_node_replaced(reply: Reply, data: st.DataObject) -> None:
    obj = body_map(reply)
    path = data.draw(st.sampled_from(paths(obj)))
    assert_same(replace_at(obj, path, data.draw(msgpack_values)))


@PROPS
@given(reply=replies, data=st.data())
def test_keys_removed_or_added(reply: Reply, data: st.DataObject) -> None:
    obj = body_map(reply)
    maps = [p for p in paths(obj) if isinstance(_at(obj, p), dict) and _at(obj, p)]
    path = data.draw(st.sampled_from(maps))
    node = _at(obj, path)
    if data.draw(st.booleans()):
        del node[data.draw(st.sampled_from(sorted(node)))]
    else:
        node[data.draw(st.sampled_from(["t", "x", "as", "sc", "sd", "encoding"]))] = data.draw(
            msgpack_values
        )
    assert_same(obj)


def _at(obj: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        obj = obj[p]
    return obj


BAD_FLOATS = [np.nan, np.inf, -np.inf, 1e30, -0.0]


@PROPS
@given(reply=lean_replies(), data=st.data())
def test_array_contents_and_headers_corrupted(reply: Reply, data: st.DataObject) -> None:
    obj = body_map(reply)
    arrays = [p for p in paths(obj) if isinstance(_at(obj, p), dict) and "dt" in _at(obj, p)]
    if not arrays:
        return
    arr = _at(obj, data.draw(st.sampled_from(arrays)))
    op = data.draw(st.sampled_from(["value", "dtype", "shape", "length"]))
    if op == "value" and arr["d"]:
        values = np.frombuffer(arr["d"], dtype=arr["dt"]).copy()
        i = data.draw(st.integers(0, values.size - 1))
        if values.dtype.kind == "f":
            with np.errstate(over="ignore"):  # 1e30 in a float16 array becomes inf: wanted
                values[i] = data.draw(st.sampled_from(BAD_FLOATS))
        else:
            values[i] = data.draw(st.sampled_from([-1, 0, 7, 2**31 - 1]))
        arr["d"] = values.tobytes()
    elif op == "dtype":
        arr["dt"] = data.draw(st.sampled_from(["<f4", "<f2", "<i4", "<i8", "|u1", "|b1", ">f4"]))
    elif op == "shape":
        arr["sh"] = data.draw(st.lists(st.integers(0, 6), max_size=3))
    else:
        arr["d"] = arr["d"][: data.draw(st.integers(0, len(arr["d"])))]
    assert_same(obj)


def _outcome(fn: Any) -> tuple[str, Any]:
    try:
        return "ok", encode(fn())
    except ProtocolError as exc:
        return type(exc).__name__, str(exc)


@PROPS
@given(env=envelopes(replies), data=st.data())
def test_decode_agrees_with_the_typed_walk_on_whole_frames(
    env: Envelope, data: st.DataObject
) -> None:
    assert_frames_agree(env, data)


def assert_frames_agree(env: Envelope, data: st.DataObject) -> None:
    """``env``'s frame, maybe with one node replaced: ``codec.decode`` and the typed walk give
    the same envelope or the same error."""
    frame = msgpack.unpackb(encode(env), raw=False)
    if data.draw(st.booleans()):
        path = data.draw(st.sampled_from(paths(frame)[1:]))
        frame = replace_at(frame, path, data.draw(msgpack_values))
    try:
        packed = msgpack.packb(frame, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return
    fast = _outcome(lambda: decode(packed))
    slow = _outcome(lambda: envelope_from_map(decode_frame_map(packed), fast=False))
    assert fast == slow


def test_received_frame_is_kept_on_the_envelope() -> None:
    reply = Reply(task_id="t", round=1, phase="train", num_samples=3)
    frame = encode(Envelope(body=reply, sender="dev-1"))
    env = decode(frame)
    assert env.wire == frame
    assert env == decode(encode(env))  # not part of equality, never encoded
    assert Envelope(body=reply, sender="dev-1").wire == b""


def test_lean_arrays_are_read_only_views() -> None:
    reply = Reply(
        task_id="t",
        round=1,
        phase="train",
        num_samples=3,
        payloads={
            "protos": lean_example_protos(),
        },
    )
    got = lean.decode_body("reply", body_map(reply))
    assert got is not None
    vectors = got.payloads["protos"].vectors  # type: ignore[union-attr]
    assert not vectors.flags.writeable  # zero-copy: frozen like the dataclass around it
    with pytest.raises(ValueError):
        vectors[0, 0] = 1.0


def lean_example_protos() -> Any:
    from protocol.contract.payloads import PrototypeSet

    return PrototypeSet(
        class_ids=np.array([3, 1], np.int32),
        vectors=np.ones((2, 4), np.float32),
        counts=np.array([5, 6], np.int32),
    )


# ----- registrations and statuses (a fleet joining: 10,000 of each at once) --------------------


@st.composite
def full_registers(draw: st.DrawFn) -> Register:
    """Registers with every optional field drawn too (class names, session, feature size)."""
    reg = draw(BUILDERS["register"])
    names = draw(st.one_of(st.just([]), st.lists(st.text(min_size=1, max_size=6), max_size=4)))
    names = names if len(names) == reg.num_classes and len(set(names)) == len(names) else []
    return dataclasses.replace(
        reg,
        class_names=names,
        session=draw(st.text(max_size=8)),
        feature_dim=draw(st.integers(0, 4096)),
    )


JOINING: dict[str, tuple[type[Any], st.SearchStrategy[Any]]] = {
    "register": (Register, st.one_of(BUILDERS["register"], full_registers())),
    "status": (Status, BUILDERS["status"]),
}


def assert_same_kind(kind: str, obj: Any) -> None:
    """As ``assert_same``, for the other kinds with a lean decoder."""
    cls = JOINING[kind][0]
    try:
        want: Any = cls.from_wire(copy.deepcopy(obj), kind)
    except REJECTIONS as exc:
        want = exc
    got = lean.decode_body(kind, obj)
    if isinstance(want, Exception):
        assert got is None, f"lean accepted what the typed walk rejects: {want}"
    elif got is not None:
        assert type(got) is cls and got == want and wire_of(got) == wire_of(want)


@pytest.mark.parametrize("kind", sorted(JOINING))
@PROPS
@given(data=st.data())
def test_registrations_and_statuses_decode_equal_and_take_the_lean_path(
    kind: str, data: st.DataObject
) -> None:
    body = data.draw(JOINING[kind][1])
    obj = body_map(body)
    assert_same_kind(kind, obj)
    got = lean.decode_body(kind, body_map(body))
    assert got is not None and got == body  # the accelerator is used for valid ones


@pytest.mark.parametrize("kind", sorted(JOINING))
@PROPS
@given(data=st.data())
def test_registrations_and_statuses_with_any_node_replaced_or_keys_changed(
    kind: str, data: st.DataObject
) -> None:
    obj = body_map(data.draw(JOINING[kind][1]))
    if data.draw(st.booleans()):
        path = data.draw(st.sampled_from(paths(obj)))
        obj = replace_at(obj, path, data.draw(msgpack_values))
    else:
        maps = [p for p in paths(obj) if isinstance(_at(obj, p), dict) and _at(obj, p)]
        node = _at(obj, data.draw(st.sampled_from(maps)))
        if data.draw(st.booleans()):
            del node[data.draw(st.sampled_from(sorted(node)))]
        else:
            keys = ["t", "x", "device", "state", "detail", "session", "class_names", "width"]
            node[data.draw(st.sampled_from(keys))] = data.draw(msgpack_values)
    assert_same_kind(kind, obj)


@pytest.mark.parametrize("kind", sorted(JOINING))
@PROPS
@given(data=st.data())
def test_joining_frames_decode_as_the_typed_walk(kind: str, data: st.DataObject) -> None:
    assert_frames_agree(data.draw(envelopes(JOINING[kind][1])), data)


def _a_register() -> Register:
    from protocol.contract.messages import Capabilities, InputSpec

    return Register(
        device_id="d1",
        arch="mlp_s",
        num_params=10,
        capabilities=Capabilities(device="cpu", accelerator="", memory_mb=512, cpu_count=2),
        input_spec=InputSpec(1, 28, 28),
        num_classes=3,
        class_counts={"0": 5, "2": 1},
        algorithm="fedproto",
        class_names=["a", "b", "c"],
        session="s",
        feature_dim=64,
    )


@pytest.mark.parametrize(
    ("path", "value"),
    [
        *(
            (p, v)
            for p in (("num_params",), ("num_classes",), ("feature_dim",))
            for v in (True, 1.0)
        ),
        *((("capabilities", k), True) for k in ("memory_mb", "cpu_count")),
        *((("input_spec", k), True) for k in ("channels", "height", "width")),
        (("class_counts", "0"), True),
        (("device_id",), b"d1"),
        (("class_names", 1), b"b"),
        (("capabilities", "device"), None),
        (("input_spec", "height"), 0),  # the constructor's own check
        (("class_counts",), {"0": 5, "7": 1}),  # a class beyond num_classes
    ],
)
def test_a_register_field_of_another_type_is_left_to_the_typed_walk(
    path: tuple[Any, ...], value: Any
) -> None:
    obj = replace_at(body_map(_a_register()), path, value)
    assert lean.decode_body("register", obj) is None
    with pytest.raises(ProtocolError):
        Register.from_wire(obj, "register")
