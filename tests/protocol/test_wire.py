"""``protocol.wire``'s encoder: the shortcut for maps of plain scalars (issue 21) gives what
walking every value gives."""

from __future__ import annotations

import typing

import pytest

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
