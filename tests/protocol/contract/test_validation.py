"""Rejections name the field, what was expected and what arrived."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest

from protocol.contract.codec import Envelope, Limits, decode, encode
from protocol.contract.messages import Chunk, Register, Reply, Task
from protocol.contract.payloads import FeatureLogitSet, PrototypeSet, TensorMap
from protocol.errors import DecodeError, LimitError, ProtocolError, ValidationError


def _protos(**override: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "class_ids": [0, 3],
        "vectors": np.ones((2, 4), np.float32),
        "counts": [5, 6],
    }
    return fields | override


def _reply_frame(payload: Any = None) -> dict[str, Any]:
    body = Reply(
        task_id="t1",
        round=2,
        phase="train",
        num_samples=10,
        payloads={"protos": payload or PrototypeSet(**_protos())},
    )
    frame: dict[str, Any] = msgpack.unpackb(encode(Envelope(body=body, sender="dev-1")))
    return frame


def _decode_mutated(mutate: Callable[[dict[str, Any]], None]) -> None:
    frame = _reply_frame()
    mutate(frame)
    decode(msgpack.packb(frame, use_bin_type=True))


# -- payload constructors: the same checks run locally and on decode ----------------------


@pytest.mark.parametrize(
    ("override", "field", "expected"),
    [
        ({"vectors": np.array([[1, np.nan, 0, 0], [0, 0, 0, 0]], np.float32)}, "vectors", "finite"),
        ({"vectors": np.ones((3, 4), np.float32)}, "vectors", "shape [2, *]"),
        ({"counts": [1, 2, 3]}, "counts", "shape [2]"),
        ({"class_ids": [-1, 3]}, "class_ids", "non-negative"),
        ({"class_ids": [3, 3]}, "class_ids", "unique"),
        ({"class_ids": [0.5, 3]}, "class_ids", "integer"),
        ({"counts": [-1, 2]}, "counts", "non-negative"),
        ({"sd": np.zeros(4, np.float32)}, "sd", "positive"),
        ({"sd": np.ones(5, np.float32)}, "sd", "shape [4]"),
        ({"encoding": "i8"}, "encoding", "one of"),
    ],
)
def test_prototype_set_checks_name_the_field(
    override: dict[str, Any], field: str, expected: str
) -> None:
    with pytest.raises(ValidationError) as info:
        PrototypeSet(**_protos(**override))
    assert info.value.field == field
    assert expected in info.value.expected


def test_feature_logits_class_ids_must_be_below_the_number_of_classes() -> None:
    with pytest.raises(ValidationError, match="class ids < 3") as info:
        FeatureLogitSet(
            class_ids=np.array([0, 5], np.int32),
            features=np.ones((2, 2), np.float32),
            logits=np.ones((2, 3), np.float32),
            counts=np.array([1, 1], np.int32),
        )
    assert info.value.field == "class_ids" and info.value.got == 5


def test_tensor_map_refuses_non_finite_values_by_name() -> None:
    with pytest.raises(ValidationError) as info:
        TensorMap({"layer.weight": np.array([1.0, np.inf], np.float32)})
    assert info.value.field == "tensors.layer.weight"


def test_register_class_counts_must_be_known_classes() -> None:
    with pytest.raises(ValidationError, match="class_counts") as info:
        Register(
            device_id="d",
            arch="cnn",
            num_params=1,
            capabilities=None,  # type: ignore[arg-type]
            input_spec=None,
            num_classes=3,
            class_counts={"7": 1},  # type: ignore[arg-type]
            algorithm="fedavg",
        )
    assert info.value.got == "7"


def test_chunk_digest_must_be_sha256_sized() -> None:
    with pytest.raises(ValidationError, match="32 bytes") as info:
        Chunk(digest=b"short", index=0, count=1, total_size=1, data=b"x")
    assert info.value.field == "digest"


# -- decoding: errors carry the path inside the message -----------------------------------


def _set_vector_nan(f: dict[str, Any]) -> None:
    vec = f["b"]["payloads"]["protos"]["vectors"]
    vec["d"] = np.array([np.nan] * 8, np.float32).tobytes()


@pytest.mark.parametrize(
    ("mutate", "field", "expected"),
    [
        (_set_vector_nan, "reply.payloads.protos.vectors", "finite"),
        (
            lambda f: f["b"]["payloads"]["protos"]["vectors"].update(sh=[4, 2]),
            "reply.payloads.protos.vectors",
            "shape [2, *]",
        ),
        (
            lambda f: f["b"]["payloads"]["protos"]["class_ids"].update(
                d=np.array([-4, 1], "<i4").tobytes()
            ),
            "reply.payloads.protos.class_ids",
            "non-negative",
        ),
        (lambda f: f["b"].update(extra=1), "reply", "fields of Reply"),
        (lambda f: f["b"].pop("task_id"), "reply.task_id", "required"),
        (lambda f: f["b"].update(num_samples=True), "reply.num_samples", "int"),
        (lambda f: f["b"].update(num_samples=-3), "reply.num_samples", "non-negative"),
        (lambda f: f["b"].update(metrics={"acc": float("nan")}), "reply.metrics.acc", "finite"),
        (
            lambda f: f["b"]["payloads"]["protos"].update(t="bogus"),
            "reply.payloads.protos.t",
            "one of",
        ),
        (
            lambda f: f["b"]["payloads"]["protos"]["vectors"].update(dt="<f8"),
            "reply.payloads.protos.vectors.dt",
            "one of",
        ),
        (lambda f: f.update(k="nonsense"), "frame.k", "one of"),
        (lambda f: f.update(r=-1), "frame.r (round)", "non-negative"),
        (lambda f: f.update(s=""), "frame.s (sender)", "1..128"),
        (lambda f: f.update(t=5), "frame.t (timestamp)", "float"),
        (lambda f: f.update(x=1), "frame", "keys"),
    ],
)
def test_decoding_errors_name_the_field(
    mutate: Callable[[dict[str, Any]], None], field: str, expected: str
) -> None:
    with pytest.raises(ValidationError) as info:
        _decode_mutated(mutate)
    assert info.value.field == field
    assert expected in info.value.expected
    assert field in str(info.value)


def test_schema_version_mismatch_is_a_decode_error() -> None:
    with pytest.raises(DecodeError, match="schema version 1, got 2"):
        _decode_mutated(lambda f: f.update(v=2))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        b"\x93\x01\x02\x03",
        encode(
            Envelope(
                body=Task(task_id="t", run_id="r", round=0, phase="p", deadline=1.0, algorithm="a"),
                sender="c",
            )
        )
        + b"\x00",
    ],
)
def test_non_frames_are_decode_errors(data: bytes) -> None:
    with pytest.raises(DecodeError):
        decode(data)


def test_oversized_frame_is_refused_by_length_first() -> None:
    data = encode(
        Envelope(
            body=Reply(
                task_id="t",
                round=0,
                phase="p",
                num_samples=1,
                payloads={"w": TensorMap({"w": np.zeros(1000, np.float32)})},
            ),
            sender="d",
        )
    )
    with pytest.raises(LimitError, match="cap"):
        decode(data, Limits(max_message=1000))


def test_every_rejection_is_a_protocol_error() -> None:
    for exc in (DecodeError, ValidationError, LimitError):
        assert issubclass(exc, ProtocolError)
