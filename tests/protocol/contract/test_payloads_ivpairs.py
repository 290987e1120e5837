"""ImageVectorPairs: the classes and the making round travel inside the payload (FedKTL)."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from protocol.contract.codec import Envelope, decode, encode
from protocol.contract.messages import Task
from protocol.contract.payloads import ImageVectorPairs
from protocol.errors import ValidationError


def _fields(**override: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "images": np.arange(3 * 1 * 2 * 2, dtype=np.uint8).reshape(3, 1, 2, 2),
        "vectors": np.ones((3, 4), np.float32),
        "class_ids": [4, 0, 7],
        "round": 2,
    }
    return fields | override


def _task(pairs: ImageVectorPairs) -> Task:
    return Task(
        task_id="t1",
        run_id="r",
        round=3,
        phase="train",
        deadline=0.0,
        algorithm="fedktl",
        payloads={"pairs": pairs},
    )


def test_class_ids_and_round_survive_the_wire_as_int32_and_int() -> None:
    sent = ImageVectorPairs(**_fields(), encoding="f16")
    body = decode(encode(Envelope(body=_task(sent), sender="coordinator"))).body
    assert isinstance(body, Task)
    got = body.payloads["pairs"]
    assert isinstance(got, ImageVectorPairs) and got.class_ids is not None
    assert got.class_ids.dtype == np.int32 and got.class_ids.tolist() == [4, 0, 7]
    assert got.round == 2


def test_absent_class_ids_and_round_zero_are_left_off_the_wire() -> None:
    pairs = ImageVectorPairs(**_fields(class_ids=None, round=0))
    assert list(pairs.to_wire()) == ["images", "vectors"]  # encoding "raw" is the default too
    assert ImageVectorPairs.from_wire(pairs.to_wire()).class_ids is None


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ({"class_ids": [4, 0]}, r"shape \[3\]"),  # one id per image
        ({"class_ids": [[4, 0, 7]]}, r"shape \[3\]"),
        ({"class_ids": [4, 4, 7]}, "unique class ids"),
        ({"class_ids": [4, -1, 7]}, "non-negative class ids"),
        ({"class_ids": np.array([4.0, 0.0, 7.0])}, "integer array"),
        ({"class_ids": ["a", "b", "c"]}, "numeric array"),
    ],
)
def test_bad_class_ids_are_refused_naming_class_ids(
    override: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ValidationError, match=expected) as err:
        ImageVectorPairs(**_fields(**override))
    assert err.value.field == "class_ids"


@pytest.mark.parametrize("value", [-1, True, 1.5])
def test_round_is_a_non_negative_int(value: object) -> None:
    with pytest.raises(ValidationError) as err:
        ImageVectorPairs(**_fields(round=value))
    assert err.value.field == "round"


def test_a_peer_frame_with_duplicate_class_ids_is_refused_on_decode() -> None:
    sent = Envelope(body=_task(ImageVectorPairs(**_fields())), sender="c")
    frame = msgpack.unpackb(encode(sent))
    frame["b"]["payloads"]["pairs"]["class_ids"].update(d=np.array([1, 1, 2], "<i4").tobytes())
    with pytest.raises(ValidationError) as err:
        decode(msgpack.packb(frame, use_bin_type=True))
    assert err.value.field == "task.payloads.pairs.class_ids"
    assert "unique" in err.value.expected
