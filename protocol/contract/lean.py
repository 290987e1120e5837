"""Lean decoding of the messages a coordinator receives by the thousand: replies, and the
registrations and statuses of a fleet joining.

The typed converter (``protocol.contract.wire``) walks field annotations for every value and then
runs
each dataclass's ``__post_init__``; for a FedProto reply that is ~100 Python calls and a dozen
numpy round trips per message. This module decodes the common shape of a reply directly: flat
type checks on the msgpack map, arrays as zero-copy, read-only :func:`numpy.frombuffer` views of
the received bytes, and the payload checks (shapes, finiteness, class ids, counts) done once,
vectorised, before the frozen dataclass is filled in without running its checks again.

Contract (tested in ``tests/protocol/contract/test_lean_*.py``): :func:`decode_body` returns a body
*only* when the typed path would accept the same map and build an equal message; for anything
else, valid or not, it returns ``None`` and the caller runs the typed path, which accepts it or
raises its precise :class:`~protocol.errors.ValidationError`. So the lean path can never accept
more, reject differently or word an error differently; it is an accelerator, not a second
validator. Shapes it does not know (other payload kinds, quantised arrays, a stray key) simply
take the typed path.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from protocol.contract.arrays import MAX_NDIM
from protocol.contract.messages import MAX_NAME, Capabilities, InputSpec, Register, Reply, Status
from protocol.contract.payloads import FeatureLogitSet, PrototypeSet
from protocol.contract.validate import sum_of_squares
from protocol.contract.wire import WireModel
from protocol.errors import ValidationError

__all__ = ["KINDS", "decode_body"]

_MAX_ARRAY_BYTES = 1 << 30  # decode_array's default bound, checked the same progressive way
_REPLY_KEYS = frozenset({"task_id", "round", "phase", "num_samples", "payloads", "metrics"})
_I4, _F4, _F2 = np.dtype("<i4"), np.dtype("<f4"), np.dtype("<f2")
_ENCODINGS = ("raw", "f16")  # what PrototypeSet and FeatureLogitSet accept


def _new(cls: type[Any], **values: Any) -> Any:
    """A frozen slots dataclass filled in without ``__init__``: its checks were done here."""
    obj = object.__new__(cls)
    setters = _SETTERS.get(cls) or _setters(cls)
    for name, value in values.items():
        setters[name](obj, value)
    return obj


_SETTERS: dict[type[Any], dict[str, Callable[[Any, Any], None]]] = {}


def _setters(cls: type[Any]) -> dict[str, Callable[[Any, Any], None]]:
    """The ``__set__`` of each slot of ``cls`` (what ``object.__setattr__`` looks up per call),
    kept once: a frozen dataclass's own ``__setattr__`` refuses, its slots do not."""
    found = {f.name: getattr(cls, f.name).__set__ for f in dataclasses.fields(cls)}
    _SETTERS[cls] = found
    return found


def _count(sh: Any, itemsize: int) -> int:
    """Element count of a shape ``decode_array`` would accept (byte bound included), or -1."""
    if type(sh) is not list or len(sh) > MAX_NDIM:
        return -1
    count = 1
    for s in sh:
        if type(s) is not int or s < 0:
            return -1
        count *= s
        if count * itemsize > _MAX_ARRAY_BYTES:
            return -1
    return count


def _array(obj: Any, dtype: np.dtype[Any], dtype_str: str) -> npt.NDArray[Any] | None:
    """An exact ``dtype`` array map, or an f16 map of a float32 field, as the typed path
    decodes it (f16 arrays are widened: a copy); anything else is None."""
    if type(obj) is not dict:
        return None
    n, dt = len(obj), obj.get("dt")
    if n == 3 and dt == dtype_str:
        wire = dtype
    elif n == 4 and dt == "<f2" and dtype is _F4 and obj.get("as") == "<f4":
        wire = _F2
    else:
        return None
    sh, data = obj.get("sh"), obj.get("d")
    if type(data) is not bytes or _count(sh, wire.itemsize) * wire.itemsize != len(data):
        return None
    # a read-only view of the received bytes (np.frombuffer + reshape in one call)
    arr: npt.NDArray[Any] = np.ndarray(typing.cast(list[int], sh), wire, data)
    return arr.astype(_F4) if wire is _F2 else arr


def _finite(arr: npt.NDArray[Any]) -> bool:
    """No NaN or inf, by one reduction (:func:`~protocol.contract.validate.sum_of_squares`). A
    finite
    sum that overflows (values beyond ~1e19) says False too, and the typed walk decides, as for
    anything the lean path does not vouch for."""
    return math.isfinite(sum_of_squares(arr))


def _ids_ok(ids: list[int], below: int | None) -> bool:
    """check_class_ids: non-negative, below ``below`` when given, unique."""
    if not ids:
        return True
    if min(ids) < 0 or (below is not None and max(ids) >= below):
        return False
    return len(set(ids)) == len(ids)


def _encoding(obj: dict[str, Any]) -> str | None:
    enc = obj.get("encoding", "raw")
    return enc if type(enc) is str and enc in _ENCODINGS else None


_PROTO_KEYS = frozenset({"t", "class_ids", "vectors", "counts", "sd", "encoding"})


def _protos(obj: dict[str, Any]) -> PrototypeSet | None:
    if not obj.keys() <= _PROTO_KEYS:
        return None
    enc = _encoding(obj)
    ids = _array(obj.get("class_ids"), _I4, "<i4")
    vectors = _array(obj.get("vectors"), _F4, "<f4")
    counts = _array(obj.get("counts"), _I4, "<i4")
    if enc is None or ids is None or vectors is None or counts is None:
        return None
    if ids.ndim != 1 or vectors.ndim != 2 or counts.shape != ids.shape:
        return None
    if vectors.shape[0] != ids.shape[0] or not _ids_ok(ids.tolist(), None):
        return None
    if not _finite(vectors) or min(counts.tolist(), default=0) < 0:
        return None
    sd = obj.get("sd")
    if sd is not None:
        sd = _array(sd, _F4, "<f4")
        if sd is None or sd.shape != (vectors.shape[1],) or not _finite(sd):
            return None
        if sd.size and float(sd.min()) <= 0:
            return None
    return _new(PrototypeSet, class_ids=ids, vectors=vectors, counts=counts, sd=sd, encoding=enc)  # type: ignore[no-any-return]


_FEATLOGIT_KEYS = frozenset({"t", "class_ids", "features", "logits", "counts", "encoding"})


def _featlogits(obj: dict[str, Any]) -> FeatureLogitSet | None:
    if not obj.keys() <= _FEATLOGIT_KEYS:
        return None
    enc = _encoding(obj)
    ids = _array(obj.get("class_ids"), _I4, "<i4")
    features = _array(obj.get("features"), _F4, "<f4")
    logits = _array(obj.get("logits"), _F4, "<f4")
    counts = _array(obj.get("counts"), _I4, "<i4")
    if enc is None or ids is None or features is None or logits is None or counts is None:
        return None
    m = ids.shape[0] if ids.ndim == 1 else -1
    if m < 0 or features.ndim != 2 or logits.ndim != 2 or counts.shape != (m,):
        return None
    if features.shape[0] != m or logits.shape[0] != m:
        return None
    if not _ids_ok(ids.tolist(), logits.shape[1] if m else None):
        return None
    if not _finite(features) or not _finite(logits):
        return None
    return _new(  # type: ignore[no-any-return]
        FeatureLogitSet,
        class_ids=ids,
        features=features,
        logits=logits,
        counts=counts,
        encoding=enc,
    )


_PAYLOADS: dict[str, Callable[[dict[str, Any]], WireModel | None]] = {
    "protos": _protos,
    "featlogits": _featlogits,
}


def _payloads(obj: Any) -> dict[str, Any] | None:
    if type(obj) is not dict:
        return None
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if type(key) is not str or type(value) is not dict:
            return None
        kind = value.get("t")
        decode = _PAYLOADS.get(kind) if type(kind) is str else None
        payload = None if decode is None else decode(value)
        if payload is None:
            return None
        out[key] = payload
    return out


def _metrics(obj: Any) -> dict[str, float] | None:
    if type(obj) is not dict:
        return None
    out: dict[str, float] = {}
    for key, value in obj.items():
        if type(key) is not str:
            return None
        kind = type(value)
        if kind is float:
            if not math.isfinite(value):
                return None
        elif kind is not int:
            return None
        out[key] = float(value)
    return out


def _reply(obj: Any) -> Reply | None:
    if type(obj) is not dict or not obj.keys() <= _REPLY_KEYS:
        return None
    task_id, round_, phase, samples = (
        obj.get("task_id"),
        obj.get("round"),
        obj.get("phase"),
        obj.get("num_samples"),
    )
    if type(task_id) is not str or not 0 < len(task_id) <= MAX_NAME:
        return None
    if type(round_) is not int or type(phase) is not str:
        return None
    if type(samples) is not int or samples < 0:
        return None
    payloads = _payloads(obj.get("payloads", {}))
    metrics = _metrics(obj.get("metrics", {}))
    if payloads is None or metrics is None:
        return None
    return _new(  # type: ignore[no-any-return]
        Reply,
        task_id=task_id,
        round=round_,
        phase=phase,
        num_samples=samples,
        payloads=payloads,
        metrics=metrics,
    )


def _fields(cls: type[Any], *, required: bool = False) -> frozenset[str]:
    """``cls``'s field names (``required``: those without a default)."""
    return frozenset(
        f.name
        for f in dataclasses.fields(cls)
        if not required
        or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    )


_REGISTER_KEYS, _CAPS_KEYS = _fields(Register), _fields(Capabilities)
_SPEC_KEYS, _REQUIRED = _fields(InputSpec), _fields(Register, required=True)


def _scalar_fields(cls: type[Any]) -> dict[str, type]:
    """``cls``'s ``str`` and ``int`` fields with their type, from its annotations."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if hints[f.name] in (str, int)}


_REGISTER_TYPES, _CAPS_TYPES = _scalar_fields(Register), _scalar_fields(Capabilities)


def _exact(obj: dict[str, Any], types: dict[str, type]) -> bool:
    """Every key of ``obj`` that ``types`` names holds a value of exactly that type (a bool is
    not an int: the typed walk refuses it)."""
    return all(type(obj[k]) is t for k, t in types.items() if k in obj)


def _register(obj: Any) -> Register | None:
    """Plain type checks on the map, then the dataclasses' own constructors (their checks run,
    and a refusal leaves the wording to the typed walk)."""
    if type(obj) is not dict or not _REQUIRED <= obj.keys() <= _REGISTER_KEYS:
        return None
    caps, spec = obj["capabilities"], obj["input_spec"]
    counts, names = obj.get("class_counts", {}), obj.get("class_names", [])
    classes = obj.get("classes", [])
    if type(caps) is not dict or not caps.keys() <= _CAPS_KEYS or "device" not in caps:
        return None
    if type(spec) is not dict or spec.keys() != _SPEC_KEYS or type(counts) is not dict:
        return None
    if not (_exact(obj, _REGISTER_TYPES) and _exact(caps, _CAPS_TYPES)):
        return None
    if not all(type(v) is int for v in spec.values()) or type(names) is not list:
        return None
    if not all(type(k) is str and type(v) is int for k, v in counts.items()):
        return None
    if not all(type(n) is str for n in names):
        return None
    if type(classes) is not list or not all(type(c) is int for c in classes):
        return None
    values: dict[str, Any] = {k: v for k, v in obj.items() if k in _REGISTER_TYPES}
    if "class_names" in obj:
        values["class_names"] = list(names)
    if "classes" in obj:
        values["classes"] = list(classes)
    try:
        return Register(
            capabilities=Capabilities(**caps),
            input_spec=InputSpec(**spec),
            class_counts=dict(counts),
            **values,
        )
    except ValidationError:
        return None


_STATES = frozenset({"online", "offline", "busy", "done"})


def _status(obj: Any) -> Status | None:
    if type(obj) is not dict or not {"state"} <= obj.keys() <= {"state", "detail"}:
        return None
    state, detail = obj["state"], obj.get("detail", "")
    if type(state) is not str or state not in _STATES or type(detail) is not str:
        return None
    return Status(state=state, detail=detail)  # type: ignore[arg-type]


#: Message kinds with a lean decoder.
KINDS: dict[str, Callable[[Any], WireModel | None]] = {
    Reply.KIND: _reply,
    Register.KIND: _register,
    Status.KIND: _status,
}


def decode_body(kind: str, obj: Any) -> WireModel | None:
    """The body of a ``kind`` message if the lean path can vouch for it, else ``None``."""
    decode = KINDS.get(kind)
    if decode is None:
        return None
    try:
        return decode(obj)
    except (ValueError, TypeError, OverflowError):  # not expected; the typed walk decides
        return None
