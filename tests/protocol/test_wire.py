"""``protocol.wire``'s encoder: the shortcut for maps of plain scalars (issue 21) gives what
walking every value gives."""

from __future__ import annotations

import dataclasses
import typing

import msgpack
import numpy as np
import pytest
import typing_extensions

from protocol import wire
from protocol.messages import Reply, Task

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
