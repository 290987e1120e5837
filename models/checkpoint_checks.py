"""Validation of a checkpoint's untrusted content (a file may come from another machine or
toolkit version): each value checked against its declared type by the one typed decoder, and
the state dict against the architecture it claims. Every mismatch is a :class:`CheckpointError`
that names the offending key."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import Tensor

from protocol.contract.wire import from_plain
from protocol.errors import EdgeFLError, ValidationError
from protocol.logs import listing

if TYPE_CHECKING:
    from models.checkpoint import ModelSpec

__all__ = [
    "STR_MAP",
    "CheckpointError",
    "as_tensor",
    "as_type",
    "check_meta",
    "check_state_dict",
    "describe",
    "first_line",
    "int_at_least",
    "required",
    "tensor_map",
]

# Known meta keys, their types and, where the decoder's own is not used, a mismatch's wording.
# Missing keys are allowed (an exporter fills blanks), but a present key of the wrong type is an
# error: it would end up wrong in the ONNX metadata.
_META_TYPES: dict[str, tuple[Any, str | None]] = {
    "algorithm": (str, None),
    "round": (int, None),
    "federation": (str, None),
    "run_id": (str, None),
    "device_id": (str, None),
    "class_names": (list[str], "a list of str"),
    "toolkit_version": (str, None),
    "metrics": (dict[str, object], None),  # numbers, NaN allowed: checked below
}
STR_MAP = dict[str, object]  # a map with string keys, its values checked by the caller


class CheckpointError(EdgeFLError):
    """A checkpoint is missing, unreadable, malformed, or does not fit its declared model."""


def check_state_dict(
    expected: Mapping[str, Tensor], got: Mapping[str, Tensor], spec: ModelSpec
) -> None:
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected]
    mismatched = [
        f"{k}: checkpoint {list(got[k].shape)} vs model {list(v.shape)}"
        for k, v in expected.items()
        if k in got and got[k].shape != v.shape
    ]
    if not (missing or unexpected or mismatched):
        return
    parts = [
        f"{len(items)} {label} ({listing(items, 5)})"
        for label, items in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("shape-mismatched", mismatched),
        )
        if items
    ]
    raise CheckpointError(
        f"state_dict does not match {spec.name}(num_classes={spec.num_classes}, "
        f"in_chans={spec.in_chans}, feature_dim={spec.feature_dim}, "
        f"input_size={list(spec.input_size)}): " + "; ".join(parts)
    )


def as_type(tp: Any, value: object, where: str, expected: str | None = None) -> Any:
    """``value`` as type ``tp`` by the one typed decoder
    (:func:`protocol.contract.wire.from_plain`); a
    mismatch is a :class:`CheckpointError`, worded ``expected`` where that is given."""
    try:
        return from_plain(tp, value, where)
    except ValidationError as exc:
        if expected is None:
            raise CheckpointError(str(exc)) from None
        raise CheckpointError(f"{where}: expected {expected}, got {describe(value)}") from None


def required(
    d: Mapping[str, Any], key: str, tp: Any, where: str, expected: str | None = None
) -> Any:
    """``d[key]`` as type ``tp`` (see :func:`as_type`); a missing key is an error."""
    if key not in d:
        raise CheckpointError(f"{where}: missing key {key!r}")
    return as_type(tp, d[key], f"{where}.{key}", expected)


def int_at_least(d: Mapping[str, Any], key: str, minimum: int, where: str) -> int:
    value: int = required(d, key, int, where)
    if value < minimum:
        raise CheckpointError(f"{where}.{key}: expected an int >= {minimum}, got {value!r}")
    return value


def as_tensor(value: object, where: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise CheckpointError(f"{where}: expected a tensor, got {describe(value)}")
    return value


def tensor_map(obj: object, where: str) -> dict[str, Tensor]:
    d: dict[str, Tensor] = as_type(STR_MAP, obj, where)
    for key, value in d.items():
        as_tensor(value, f"{where}[{key!r}]")
    return d


def check_meta(obj: object, where: str) -> dict[str, Any]:
    d: dict[str, Any] = as_type(STR_MAP, obj, where)
    for key, (tp, expected) in _META_TYPES.items():
        if key in d:
            as_type(tp, d[key], f"{where}.{key}", expected)
    for name, value in d.get("metrics", {}).items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise CheckpointError(
                f"{where}.metrics.{name}: expected a float, got {describe(value)}"
            )
    return d


def describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    shown = repr(value)
    return shown if len(shown) <= 60 else f"{type(value).__name__} {shown[:57]}..."


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
