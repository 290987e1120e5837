"""Generic, type-driven conversion between frozen dataclasses and msgpack-ready values.

Every wire message and payload is a frozen dataclass whose field annotations are drawn from a
small vocabulary: ``bool``, ``int``, ``float``, ``str``, ``bytes``, ``numpy.ndarray``, another
:class:`WireModel`, a union of tagged :class:`WireModel` types, ``X | None``, ``list[X]``,
``tuple[X, ...]`` and ``dict[str, X]``. One converter walks those annotations in both directions,
so adding a message never means writing another encoder or decoder. Decoding validates the type
of every field and then runs the dataclass's ``__post_init__`` checks (shapes, ranges, finite).

The decoding half is public as :func:`from_plain`, the one typed decoder of the toolkit: run
configs, checkpoint metadata and data specs check their plain values with it too. It stays
hand-written: msgspec (typed msgpack decoding in C) was measured against it and is faster on
the flat kinds, but cannot decode a tagged union of dataclasses (every payload map) or an
array, lets unknown keys and NaN through, and words its errors its own way; the kinds that
arrive by the thousand have ``protocol.contract.lean`` instead.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import types
import typing
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, TypeVar, Union

import numpy as np

from protocol.contract.arrays import Encoding, decode_array, encode_array
from protocol.errors import ProtocolError, ValidationError

__all__ = ["WireModel", "from_plain", "from_wire", "reuse_encodings", "tagged_wire", "to_wire"]

T = TypeVar("T", bound="WireModel")


class WireModel:
    """Base of every wire dataclass. ``KIND`` tags it inside unions and envelopes."""

    KIND: ClassVar[str] = ""
    # Name of a field holding the lossy encoding applied to the model's float arrays, if any.
    ENCODING_FIELD: ClassVar[str | None] = None

    def to_wire(self) -> dict[str, Any]:
        """This object as a msgpack-ready map (field order = declaration order)."""
        return _encode_model(self)

    @classmethod
    def from_wire(cls: type[T], obj: Any, path: str = "") -> T:
        """Validate ``obj`` (as produced by msgpack) and build an instance of ``cls``."""
        return _decode_model(cls, obj, path or cls.KIND or cls.__name__)


def to_wire(model: WireModel) -> dict[str, Any]:
    """Module-level alias of :meth:`WireModel.to_wire`."""
    return model.to_wire()


def from_wire(cls: type[T], obj: Any, path: str = "") -> T:
    """Module-level alias of :meth:`WireModel.from_wire`."""
    return cls.from_wire(obj, path)


def from_plain(tp: Any, value: Any, path: str) -> Any:
    """``value``, a plain value as msgpack, JSON, TOML or ``torch.load`` give it, checked and
    converted to the type expression ``tp`` by the rules of the wire: a bool is no int, an int
    in a float field becomes a float, floats must be finite, a list stands for ``list[X]`` and
    ``tuple[X, ...]``, map keys are strings. ``tp`` is drawn from the vocabulary of the wire
    models (see the module's docstring), ``Literal`` of strings, ``Any`` (a bool, int, float
    or str) and ``object`` (any value, unchecked: a map whose values another check reads).

    Raises:
        ValidationError: Naming the first offending place under ``path``.
    """
    return _decode_value(value, tp, path)


_HINTS: dict[type, tuple[tuple[str, Any], ...]] = {}
_DEFAULTS: dict[type, frozenset[str]] = {}


def _hints(cls: type) -> tuple[tuple[str, Any], ...]:
    found = _HINTS.get(cls)
    if found is None:  # resolved once per class (a plain dict: functools.cache trips mypy here)
        hints = typing.get_type_hints(cls)
        found = _HINTS[cls] = tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))
    return found


_LOCAL = threading.local()


@contextmanager
def reuse_encodings() -> Iterator[None]:
    """Within this block (on this thread), a nested model met again, the *same object*, is
    encoded once and its wire map reused: the coordinator puts one global-knowledge payload
    into every agent's task of a round, and re-walking its arrays per agent costs 13-19 % of
    the coordinator's time at 1000 agents. Keyed by identity and holding the object,
    so an equal but new object is encoded anew; the block must not mutate arrays in place.

    Likewise a field whose value is the same object as in the last model of the same class
    (and encoding) encoded in the block takes that model's encoded field: a step's tasks differ
    only in their ids and the agents' own payloads, so the other fields (the config map, run id,
    deadline) are walked once a step instead of once a task. The frames stay byte-identical.
    """
    outer = getattr(_LOCAL, "cache", None)
    outer_last = getattr(_LOCAL, "last", None)
    _LOCAL.cache = {} if outer is None else outer
    _LOCAL.last = {} if outer_last is None else outer_last
    try:
        yield
    finally:
        _LOCAL.cache, _LOCAL.last = outer, outer_last


def _nested_to_wire(model: WireModel) -> dict[str, Any]:
    cache: dict[int, tuple[WireModel, dict[str, Any]]] | None = getattr(_LOCAL, "cache", None)
    if cache is None:
        return model.to_wire()
    hit = cache.get(id(model))
    if hit is not None and hit[0] is model:
        return hit[1]
    body = model.to_wire()
    cache[id(model)] = (model, body)
    return body


def tagged_wire(model: WireModel) -> dict[str, Any]:
    """``model``'s wire map tagged with its kind (``{"t": KIND, ...}``, as a union member is),
    reusing the map made earlier in the same :func:`reuse_encodings` block."""
    return {"t": type(model).KIND, **_nested_to_wire(model)}


def _encode_model(model: WireModel) -> dict[str, Any]:
    cls = type(model)
    enc_field = cls.ENCODING_FIELD
    encoding: Encoding = getattr(model, enc_field) if enc_field else "raw"
    omittable = _omittable(cls)
    last: dict[tuple[type, str], _Encoded] | None = getattr(_LOCAL, "last", None)
    prev = None if last is None else last.get((cls, encoding))
    values: list[Any] = []
    encoded: list[Any] = []
    out: dict[str, Any] = {}
    for i, (name, tp) in enumerate(_hints(cls)):
        value = getattr(model, name)
        if prev is not None and prev[0][i] is value:
            enc = prev[1][i]  # immutable within the block: the same object encodes the same
        elif name in omittable and _is_default(value, omittable[name]):
            enc = _OMITTED  # canonical form: a field equal to its default is left out (WIRE.md §3)
        else:
            enc = _encode_value(value, tp, encoding, name)
        values.append(value)
        encoded.append(enc)
        if enc is not _OMITTED:
            out[name] = enc
    if last is not None:  # holding the values keeps their ids from being reused
        last[(cls, encoding)] = (values, encoded)
    return out


_OMITTED = object()  # marks a field left out of a wire map
_Encoded = tuple[list[Any], list[Any]]  # a model's field values and their encodings


_EMPTY = object()  # marks a default factory that builds an empty container
_OMITTABLE: dict[type, dict[str, Any]] = {}


def _omittable(cls: type) -> dict[str, Any]:
    """Fields whose default is a scalar, ``None`` or an empty container, with that default."""
    found = _OMITTABLE.get(cls)
    if found is None:
        found = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                if f.default is None or isinstance(f.default, (bool, int, float, str, bytes)):
                    found[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                made = f.default_factory()
                if isinstance(made, (dict, list, tuple)) and not made:
                    found[f.name] = _EMPTY
        _OMITTABLE[cls] = found
    return found


def _is_default(value: Any, default: Any) -> bool:
    if default is _EMPTY:
        return isinstance(value, (dict, list, tuple)) and not value
    if default is None:
        return value is None
    return type(value) is type(default) and bool(value == default)


def _encode_value(value: Any, tp: Any, encoding: Encoding, path: str) -> Any:
    if value is None:
        return None
    origin = _origin(tp)
    if tp is np.ndarray or origin is np.ndarray:
        return encode_array(value, encoding, path)
    if isinstance(value, WireModel):
        if _is_union(tp):  # tagged: the receiver needs to know which member it is
            return tagged_wire(value)
        return _nested_to_wire(value)
    if origin in (list, tuple):
        (item_tp, *_rest) = _args(tp)
        return [_encode_value(v, item_tp, encoding, f"{path}[]") for v in value]
    if origin is dict:
        _k, item_tp = _args(tp)
        same = _identity_types(item_tp)
        if same and all(type(v) in same for v in value.values()):
            return dict(value)  # e.g. a task's config map: every value encodes as itself
        return {k: _encode_value(v, item_tp, encoding, f"{path}.{k}") for k, v in value.items()}
    if _is_union(tp):  # X | None and scalar unions: encode by the value's own type
        for member in _args(tp):
            m_origin = _origin(member) or member
            if isinstance(m_origin, type) and isinstance(value, m_origin):
                return _encode_value(value, member, encoding, path)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # canonical: a float field is always a msgpack float64 on the wire
    return value


# Types whose values _encode_value returns unchanged for a field type: the members of a union of
# plain scalars (encoded by the value's own type), or the scalar type itself. A map of such
# values (a task's config, a reply's metrics) is then copied as is: walking it value by value
# is the largest cost of sending 10,000 tasks.
_PLAIN = frozenset({bool, int, float, str})
_IDENTITY: dict[Any, frozenset[type]] = {}


def _identity_types(tp: Any) -> frozenset[type]:
    try:
        return _IDENTITY[tp]
    except KeyError:
        pass
    if _is_union(tp) and all(member in _PLAIN for member in _args(tp)):
        found = frozenset(_args(tp))
    elif tp in _PLAIN:
        found = frozenset({tp})
    else:
        found = frozenset()
    _IDENTITY[tp] = found
    return found


def _is_union(tp: Any) -> bool:
    return _origin(tp) in (Union, types.UnionType)


# typing.get_origin/get_args are slow and called for every field of every message: memoise
# them per type (all field types are hashable type expressions)
_ORIGINS: dict[Any, Any] = {}
_ARGS: dict[Any, tuple[Any, ...]] = {}


def _origin(tp: Any) -> Any:
    try:
        return _ORIGINS[tp]
    except KeyError:
        pass
    found = typing.get_origin(tp)
    # A PEP 695 alias stands for its value: numpy 2.5 on Python 3.12 declares npt.NDArray as
    # one (seen on the GPU machine, where every array field then reached msgpack as a raw
    # ndarray). NDArray[np.float32]'s origin is the alias, the alias's value is an ndarray type.
    for alias in (found, tp):
        if type(alias).__name__ == "TypeAliasType":  # typing's or typing_extensions'
            value = alias.__value__
            found = typing.get_origin(value) or value
            break
    _ORIGINS[tp] = found
    return found


def _args(tp: Any) -> tuple[Any, ...]:
    try:
        return _ARGS[tp]
    except KeyError:
        found = _ARGS[tp] = typing.get_args(tp)
        return found


def _decode_model(cls: type[T], obj: Any, path: str) -> T:
    if not isinstance(obj, dict):
        raise ValidationError(path, f"map for {cls.__name__}", type(obj).__name__)
    hints = _hints(cls)
    unknown = obj.keys() - _names(cls)
    if unknown:
        shown = f"unknown {sorted(map(str, unknown))}"
        raise ValidationError(path, f"fields of {cls.__name__}", shown)
    kwargs: dict[str, Any] = {}
    for name, tp in hints:
        if name not in obj:
            if _field_has_default(cls, name):
                continue
            raise ValidationError(f"{path}.{name}", "a value (required field)", "missing")
        kwargs[name] = _decode_value(obj[name], tp, f"{path}.{name}")
    try:
        return cls(**kwargs)
    except ValidationError as exc:  # __post_init__ names the field; add where it sits
        raise ValidationError(f"{path}.{exc.field}", exc.expected, exc.got) from exc
    except (TypeError, ValueError, OverflowError, IndexError) as exc:
        raise ValidationError(path, f"valid {cls.__name__}", str(exc)) from exc


_NAMES: dict[type, frozenset[str]] = {}


def _names(cls: type) -> frozenset[str]:
    """The keys a wire map of ``cls`` may hold: its fields, and ``t`` (a union member's tag)."""
    found = _NAMES.get(cls)
    if found is None:
        found = _NAMES[cls] = frozenset([*(n for n, _ in _hints(cls)), "t"])
    return found


def _defaults(cls: type) -> frozenset[str]:
    found = _DEFAULTS.get(cls)
    if found is None:
        found = _DEFAULTS[cls] = frozenset(
            f.name
            for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        )
    return found


def _field_has_default(cls: type, name: str) -> bool:
    return name in _defaults(cls)


_SCALARS: dict[Any, tuple[type, ...]] = {
    bool: (bool,),
    int: (int,),
    float: (float, int),
    str: (str,),
    bytes: (bytes,),
}


# Field types whose value msgpack hands over as is: a value of exactly that type (and, for a
# float, finite) is what the walk below would return, so it is returned at once. Registrations
# are mostly such scalars, and the walk costs ~60 % of registering 10,000 agents.
_EXACT: dict[Any, Any] = {str: str, int: int, bool: bool, bytes: bytes, float: float}


def _decode_value(obj: Any, tp: Any, path: str) -> Any:
    exact = _EXACT.get(tp)
    if exact is not None and type(obj) is exact and (exact is not float or math.isfinite(obj)):
        return obj
    origin = _origin(tp)
    if origin is typing.Literal:
        allowed = _args(tp)
        if not isinstance(obj, str) or obj not in allowed:
            raise ValidationError(path, f"one of {list(allowed)}", obj)
        return obj
    if _is_union(tp):
        return _decode_union(obj, tp, path)
    if tp is np.ndarray or origin is np.ndarray:
        return decode_array(obj, path)
    if isinstance(tp, type) and issubclass(tp, WireModel):
        return _decode_model(tp, obj, path)
    if origin in (list, tuple):
        if not isinstance(obj, list):
            raise ValidationError(path, "list", type(obj).__name__)
        item_tp = _args(tp)[0]
        if _unchanged(obj, item_tp):
            items = list(obj)  # e.g. class names: what the walk returns
        else:
            items = [_decode_value(v, item_tp, f"{path}[{i}]") for i, v in enumerate(obj)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(obj, dict):
            raise ValidationError(path, "map", type(obj).__name__)
        _k, item_tp = _args(tp)
        for k in obj:
            if not isinstance(k, str):
                raise ValidationError(path, "string keys", k)
        if _unchanged(obj.values(), item_tp):
            return dict(obj)  # what the walk returns, without a path string per entry
        return {k: _decode_value(v, item_tp, f"{path}.{k}") for k, v in obj.items()}
    return _decode_scalar(obj, tp, path)


_SAMPLES = (True, 1, 0.5, "s", b"b")
_AS_ITSELF: dict[Any, frozenset[type]] = {}


def _as_itself(tp: Any) -> frozenset[type]:
    """The value types that the walk returns unchanged for field type ``tp``, found by walking
    one sample of each: ``int`` for ``int`` (a bool is refused), ``float`` but not ``int`` for
    ``float`` (an int becomes a float), all four for a task config's ``bool | int | float |
    str`` (the first member that accepts a value is its own type)."""
    found = _AS_ITSELF.get(tp)
    if found is None:
        found = frozenset()
        for sample in _SAMPLES:
            try:
                got = _decode_value(sample, tp, "")
            except (ProtocolError, TypeError, ValueError, KeyError, AttributeError):
                continue  # refused: that type is walked
            if type(got) is type(sample) and got == sample:
                found |= {type(sample)}
        _AS_ITSELF[tp] = found
    return found


def _unchanged(values: Iterable[Any], tp: Any) -> bool:
    """Whether the walk would return each of ``values`` as it is for item type ``tp`` (floats
    must also be finite): a map or list of them is then copied, not walked value by value."""
    same = _as_itself(tp)
    if not same:
        return False
    for v in values:
        kind = type(v)
        if kind not in same or (kind is float and not math.isfinite(v)):
            return False
    return True


def _decode_scalar(obj: Any, tp: Any, path: str) -> Any:
    if tp is object:
        return obj
    if tp is Any:
        if isinstance(obj, (bool, int, float, str)):
            return obj
        raise ValidationError(path, "bool, int, float or str", type(obj).__name__)
    allowed = _SCALARS.get(tp)
    if allowed is None:
        raise ValidationError(path, f"a supported type (not {tp!r})", type(obj).__name__)
    if not isinstance(obj, allowed) or (tp is not bool and isinstance(obj, bool)):
        raise ValidationError(path, tp.__name__, type(obj).__name__)
    if tp is float and isinstance(obj, (int, float)):
        if not math.isfinite(obj):
            raise ValidationError(path, "a finite float", obj)
        return float(obj)
    return obj


def _decode_union(obj: Any, tp: Any, path: str) -> Any:
    members = [a for a in _args(tp) if a is not type(None)]
    if obj is None:
        if len(members) < len(_args(tp)):
            return None
        raise ValidationError(path, "a value", None)
    models = [m for m in members if isinstance(m, type) and issubclass(m, WireModel)]
    if len(models) > 1 or (models and len(members) == 1 and isinstance(obj, dict) and "t" in obj):
        if not isinstance(obj, dict):
            raise ValidationError(path, "tagged map", type(obj).__name__)
        by_kind = {m.KIND: m for m in models}
        kind = obj.get("t")
        if kind not in by_kind:
            raise ValidationError(f"{path}.t", f"one of {sorted(by_kind)}", kind)
        return _decode_model(by_kind[kind], obj, path)
    if len(members) == 1:
        return _decode_value(obj, members[0], path)
    for member in members:  # scalar unions like int | float | str | bool: first exact type wins
        try:
            return _decode_value(obj, member, path)
        except ValidationError:
            continue
    raise ValidationError(path, " | ".join(getattr(m, "__name__", str(m)) for m in members), obj)
