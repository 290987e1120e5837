"""``protocol.contract.wire``'s encoder: the shortcut for maps of plain scalars gives what
walking every value gives."""

from __future__ import annotations

import dataclasses
import typing

import msgpack
import numpy as np
import pytest
import typing_extensions

from protocol.contract import wire
from protocol.contract.messages import Reply, Task
from protocol.errors import ValidationError

CONFIG_TP = typing.get_type_hints(Task)["config"]
METRICS_TP = typing.get_type_hints(Reply)["metrics"]


def walked(value: dict[str, object], tp: object, monkeypatch: pytest.MonkeyPatch) -> object:
    """The value-by-value encoding (the shortcut turned off)."""
    with monkeypatch.context() as m:
        m.setattr(wire, "_identity_types", lambda _tp: frozenset())
        return wire._encode_value(value, tp, "raw", "x")


@pytest.mark.parametrize(
    ("value", "tp"),
    [
        ({"lr": 0.01, "epochs": 3, "mixed": False, "optimizer": "sgd"}, CONFIG_TP),
        ({"acc": 0.5, "loss": 1.25}, METRICS_TP),
        ({"acc": 1}, METRICS_TP),  # an int in a float map: converted, so not the shortcut
        ({"n": True}, METRICS_TP),  # a bool is not a float either
        ({}, CONFIG_TP),
    ],
)
def test_the_scalar_map_shortcut_encodes_as_the_walk(
    value: dict[str, object], tp: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = wire._encode_value(value, tp, "raw", "x")
    slow = walked(value, tp, monkeypatch)
    assert fast == slow
    assert [type(v) for v in fast.values()] == [type(v) for v in slow.values()]  # type: ignore[union-attr]


def test_the_shortcut_applies_only_to_plain_scalar_types() -> None:
    assert wire._identity_types(typing.get_args(CONFIG_TP)[1]) == {bool, int, float, str}
    assert wire._identity_types(float) == {float}
    assert wire._identity_types(bytes) == frozenset()
    assert wire._identity_types(list[int]) == frozenset()


# numpy 2.5 on Python 3.12 declares npt.NDArray as a PEP 695 alias; the same shape, built
# with typing_extensions so that it exists on every Python the toolkit supports
_S = typing.TypeVar("_S", bound=np.generic)
AliasArray = typing_extensions.TypeAliasType(
    "AliasArray", np.ndarray[tuple[int, ...], np.dtype[_S]], type_params=(_S,)
)


@dataclasses.dataclass(frozen=True)
class Aliased(wire.WireModel):
    """Array fields annotated through a PEP 695 alias, subscripted, inside a map, and bare."""

    x: AliasArray[np.float32]
    maps: dict[str, AliasArray[typing.Any]]
    bare: AliasArray  # type: ignore[type-arg]


def test_arrays_annotated_through_a_type_alias_encode_and_decode_as_arrays() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    model = Aliased(x=a, maps={"w": a}, bare=a)
    frame = msgpack.packb(model.to_wire(), use_bin_type=True)  # raised on a raw ndarray
    back = Aliased.from_wire(msgpack.unpackb(frame, raw=False))
    for got in (back.x, back.maps["w"], back.bare):
        assert isinstance(got, np.ndarray)
        np.testing.assert_array_equal(got, a)


def test_fields_reused_within_a_block_give_the_frames_encoded_one_by_one() -> None:
    # a step's tasks share their config object, run id and deadline; ids, payloads and the
    # knowledge digest differ, and a field may go from its default (left out) to a value and
    # back; prototype sets share one array under two encodings (the encoding is in the key)
    from protocol.contract.codec import Envelope, encode
    from protocol.contract.payloads import PrototypeSet

    config = {"lr": 0.01, "epochs": 3, "optimizer": "sgd"}
    ids, vectors = np.arange(3, dtype=np.int32), np.ones((3, 4), np.float32)
    counts = np.ones(3, np.int32)
    raw = PrototypeSet(ids, vectors, counts)
    half = PrototypeSet(ids, vectors, counts, encoding="f16")
    payloads: list[dict[str, typing.Any]] = [{}, {"p": raw}, {"p": half}, {}, {"p": raw, "q": half}]

    def task(i: int) -> Task:
        return Task(
            task_id=f"run.1.0.dev{i}",
            run_id="run",
            round=1,
            phase="train",
            deadline=1e9,
            algorithm="fedproto",
            config=config if i != 3 else {"lr": 0.02},
            payloads=payloads[i],
            shared=bytes(32) if i % 2 else b"",
        )

    envs = [Envelope(body=task(i), sender="coordinator", round=1) for i in range(5)]
    alone = [encode(env) for env in envs]
    with wire.reuse_encodings():
        together = [encode(env) for env in envs]
    assert together == alone
    decoded = [msgpack.unpackb(f)["b"] for f in together]
    assert "shared" not in decoded[0] and decoded[1]["shared"] == bytes(32)
    assert decoded[3]["config"] == {"lr": 0.02} and decoded[4]["config"] == config
    assert decoded[2]["payloads"]["p"]["encoding"] == "f16"


def outcome(obj: object, tp: object) -> tuple[str, object]:
    try:
        value = wire._decode_value(obj, tp, "x")
    except ValidationError as exc:  # the error itself is what is compared
        return type(exc).__name__, str(exc)
    return type(value).__name__, value


@pytest.mark.parametrize(
    ("obj", "tp"),
    [
        ("a", str),
        (b"a", str),
        (3, int),
        (True, int),  # a bool is not an int on the wire
        (3.0, int),
        (True, bool),
        (1, bool),
        (2.5, float),
        (2, float),  # an int in a float field: converted
        (float("nan"), float),
        (float("inf"), float),
        (b"\x00", bytes),
        ("a", bytes),
        ({"0": 1, "1": 2}, dict[str, int]),
        ({"0": 1, "1": True}, dict[str, int]),
        ({"0": 1, 2: 2}, dict[str, int]),
        ({"a": 1.5, "b": 2}, dict[str, float]),
        ({"a": float("nan")}, dict[str, float]),
        (["a", "b"], list[str]),
        (["a", 1], list[str]),
        ([1, 2], tuple[int, ...]),
        ([], list[str]),
        ({"a": 1, "b": True, "c": 0.5, "d": "x"}, CONFIG_TP),
        ({"a": float("nan")}, CONFIG_TP),
        ({"a": b"x"}, CONFIG_TP),
        ({"a": None}, CONFIG_TP),
        ([1, 2.5, "x", False], list[typing.get_args(CONFIG_TP)[1]]),  # type: ignore[misc]
        ({"a": 1.5, "b": float("-inf")}, METRICS_TP),
        ({"a": {"b": 1}}, dict[str, dict[str, int]]),
    ],
)
def test_the_exact_type_shortcuts_decode_as_the_walk(
    obj: object, tp: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = outcome(obj, tp)
    monkeypatch.setattr(wire, "_EXACT", {})
    monkeypatch.setattr(wire, "_unchanged", lambda _values, _tp: False)
    slow = outcome(obj, tp)
    assert fast == slow


@pytest.mark.parametrize(
    ("obj", "tp", "outcome"),
    [
        ({"a": [1, {"b": None}], "c": b"x"}, dict[str, object], {"a": [1, {"b": None}], "c": b"x"}),
        ({1: "a"}, dict[str, object], "x: expected string keys, got 1"),
        ([1, 2], dict[str, object], "x: expected map, got 'list'"),
        ([3, 4], tuple[int, ...], (3, 4)),
        ((3, 4), tuple[int, ...], "x: expected list, got 'tuple'"),
        (None, int | None, None),
        (True, int | None, "x: expected int, got 'bool'"),
        (2, float, 2.0),
        ([1.0, float("inf")], tuple[float, ...] | None, "x[1]: expected a finite float, got inf"),
        ("adam", typing.Literal["sgd", "adam"], "adam"),
        (1, typing.Literal["sgd", "adam"], "x: expected one of ['sgd', 'adam'], got 1"),
    ],
)
def test_from_plain_is_the_walk_on_plain_values(obj: object, tp: object, outcome: object) -> None:
    """The public decoder that configs, checkpoints and data specs use: the wire's rules, and
    ``object`` taking any value unchecked."""
    try:
        got: object = wire.from_plain(tp, obj, "x")
    except ValidationError as exc:
        got = str(exc)
    assert got == outcome and type(got) is type(outcome)
