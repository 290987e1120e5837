"""Array wire maps: every allowed dtype exactly, lossy encodings within their error bounds."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protocol.contract.arrays import ALLOWED_DTYPES, decode_array, encode_array
from protocol.errors import LimitError, ValidationError

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("dtype", sorted(ALLOWED_DTYPES))
def test_every_allowed_dtype_round_trips_exactly(dtype: str) -> None:
    # Prepare
    a = (RNG.standard_normal((3, 4)) * 50).astype(dtype)
    # Execute
    wire = encode_array(a)
    back = decode_array(wire)
    # Assert
    assert wire["dt"] == dtype and wire["sh"] == [3, 4] and wire["d"] == a.tobytes()
    assert back.dtype == a.dtype and np.array_equal(back, a)
    back[0, 0] = back[0, 0]  # decoded arrays are writable copies, not views of the message


def test_big_endian_and_non_contiguous_inputs_are_normalised() -> None:
    a = np.arange(12, dtype=">f4").reshape(3, 4).T
    wire = encode_array(a)
    assert wire["dt"] == "<f4" and wire["sh"] == [4, 3]
    assert np.array_equal(decode_array(wire), a)


@pytest.mark.parametrize("dtype", ["<f8", "<u4", "<c8", "O", "<U3"])
def test_dtypes_outside_the_allow_list_are_refused_on_encode(dtype: str) -> None:
    with pytest.raises(ValidationError, match="dtype"):
        encode_array(np.zeros(2, dtype=dtype), field="w")


def test_f16_error_is_within_half_precision() -> None:
    a = RNG.standard_normal(10_000).astype(np.float32)
    back = decode_array(encode_array(a, "f16"))
    assert back.dtype == np.float32
    assert np.all(np.abs(back - a) <= np.abs(a) * 2.0**-11 + 2.0**-24)


def test_i8_error_is_at_most_half_a_step() -> None:
    a = (RNG.standard_normal(10_000) * 3).astype(np.float32)
    wire = encode_array(a, "i8")
    back = decode_array(wire)
    assert wire["dt"] == "|i1" and wire["zp"] == 0
    step = wire["sc"]
    assert step >= np.abs(a).max() / 127
    assert np.abs(back - a).max() <= step / 2 * (1 + 1e-6)
    assert len(wire["d"]) == a.size  # a quarter of the float32 bytes


def test_u8_error_is_at_most_half_of_one_255th() -> None:
    a = RNG.random(10_000).astype(np.float32)
    back = decode_array(encode_array(a, "u8"))
    assert np.abs(back - a).max() <= 0.5 / 255 + 1e-7


@settings(max_examples=60, deadline=None)
@given(
    a=hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=0, max_dims=3, max_side=6),
        elements=st.floats(-3e4, 3e4, width=32),
    ),
    encoding=st.sampled_from(["raw", "f16", "i8"]),
)
def test_lossy_encodings_are_idempotent(a: np.ndarray, encoding: Any) -> None:
    # Decoding and encoding again reproduces the same bytes: relays and vectors never drift.
    wire = encode_array(a, encoding)
    assert encode_array(decode_array(wire), encoding) == wire


@pytest.mark.parametrize("values", [[1e-35, 0.0], [-3e-31, 2e-31], [0.0], [], [7.9e-31, 1.0]])
def test_i8_is_idempotent_for_tiny_and_empty_arrays(values: list[float]) -> None:
    wire = encode_array(np.array(values, np.float32), "i8")
    assert encode_array(decode_array(wire), "i8") == wire


def test_u8_is_idempotent() -> None:
    wire = encode_array(RNG.random(1000).astype(np.float32), "u8")
    assert encode_array(decode_array(wire), "u8") == wire


@pytest.mark.parametrize(
    ("encoding", "values", "match"),
    [
        ("f16", [1.0, 70000.0], "65504"),
        ("u8", [0.5, 1.5], r"\[0, 1\]"),
        ("i8", [1.0, float("nan")], "finite"),
    ],
)
def test_lossy_encoding_refuses_values_it_cannot_carry(
    encoding: Any, values: list[float], match: str
) -> None:
    with pytest.raises(ValidationError, match=match) as info:
        encode_array(np.array(values, dtype=np.float32), encoding, field="vectors")
    assert info.value.field == "vectors"


def test_integer_arrays_ignore_lossy_encodings() -> None:
    a = np.arange(5, dtype=np.int64)
    assert encode_array(a, "i8") == encode_array(a)


def test_oversized_array_is_refused_before_allocating() -> None:
    wire = {"dt": "<f4", "sh": [1 << 20, 1 << 20], "d": b""}
    with pytest.raises(LimitError, match="exceeds"):
        decode_array(wire, "w", max_bytes=1 << 20)


@pytest.mark.parametrize(
    ("wire", "field"),
    [
        ({"dt": "<f8", "sh": [1], "d": bytes(8)}, "w.dt"),
        ({"dt": "<f4", "sh": [-1], "d": b""}, "w.sh"),
        ({"dt": "<f4", "sh": [True], "d": bytes(4)}, "w.sh"),
        ({"dt": "<f4", "sh": [1] * 9, "d": bytes(4)}, "w.sh"),
        ({"dt": "<f4", "sh": [2], "d": bytes(4)}, "w.d"),
        ({"dt": "<f4", "sh": [1], "d": "abcd"}, "w.d"),
        ({"dt": "<f4", "sh": [1], "d": bytes(4), "x": 1}, "w"),
        ({"dt": "|i1", "sh": [1], "d": bytes(1), "as": "<f4", "sc": -1.0, "zp": 0}, "w.sc"),
        ({"dt": "|i1", "sh": [1], "d": bytes(1), "as": "<f4", "sc": 1.0, "zp": 999}, "w.zp"),
        ({"dt": "|i1", "sh": [1], "d": bytes(1), "as": "<f8", "sc": 1.0, "zp": 0}, "w.as"),
        ({"dt": "|b1", "sh": [1], "d": bytes(1), "as": "<f4", "sc": 1.0, "zp": 0}, "w.dt"),
        ([1, 2], "w"),
    ],
)
def test_malformed_array_maps_name_the_field(wire: Any, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        decode_array(wire, "w")
    assert info.value.field == field
