"""The one codec: envelope <-> bytes (msgpack), with hard limits and precise rejections.

Frame layout (a msgpack map, keys in this order)::

    {"v": 1, "k": kind, "f": federation, "s": sender, "i": message id, "r": round,
     "t": unix time (float), "b": body map}

A signed frame wraps the exact bytes of an unsigned one:
``{"v": 1, "sm": <bin frame>, "g": <bin signature>, "kid": key id}`` (see
``protocol.security.signing``).
Decoding never raises anything but :class:`~protocol.errors.ProtocolError` subclasses.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack

from protocol.contract import lean
from protocol.contract.messages import MESSAGE_TYPES, Message
from protocol.errors import DecodeError, LimitError, ProtocolError, ValidationError

__all__ = [
    "DEFAULT_MAX_MESSAGE",
    "SCHEMA_VERSION",
    "Envelope",
    "FrameTemplate",
    "Limits",
    "decode",
    "decode_frame_map",
    "encode",
    "new_message_id",
]

SCHEMA_VERSION = 1
DEFAULT_MAX_MESSAGE = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Limits:
    """Decoder limits; everything derives from the hard cap on one message's size."""

    max_message: int = DEFAULT_MAX_MESSAGE
    max_items: int = 1_000_000  # entries of any one msgpack array or map

    def unpack_kwargs(self) -> dict[str, int]:
        """Keyword arguments for ``msgpack.unpackb`` that enforce these limits."""
        return {
            "max_bin_len": self.max_message,
            "max_str_len": min(self.max_message, 1 << 20),
            "max_array_len": self.max_items,
            "max_map_len": self.max_items,
            "max_ext_len": 0,
        }


_ID_POOL = bytearray()
_ID_LOCK = threading.Lock()
os.register_at_fork(after_in_child=_ID_POOL.clear)  # a forked child must not reuse our bits


def new_message_id() -> str:
    """16 hex characters (64 random bits); unique per sender in practice.

    The bits come from ``os.urandom`` 4 KiB at a time: one system call per 512 ids instead of
    one per message (a coordinator sends a task and an ack per agent and round).
    """
    with _ID_LOCK:
        if len(_ID_POOL) < 8:
            _ID_POOL.extend(os.urandom(4096))
        raw = bytes(_ID_POOL[-8:])
        del _ID_POOL[-8:]
    return raw.hex()


@dataclass(frozen=True, slots=True)
class Envelope:
    """A message with its routing metadata."""

    body: Message
    sender: str
    federation: str = "default"
    round: int = 0
    msg_id: str = field(default_factory=new_message_id)
    ts: float = field(default_factory=time.time)
    # The unsigned frame this envelope was decoded from, kept so a receiver can store what it
    # received instead of encoding it again; empty for envelopes built locally. Not part of
    # equality, never encoded. ``dataclasses.replace`` copies it: clear it when changing a
    # received envelope.
    wire: bytes = field(default=b"", compare=False, repr=False)
    # Set by the receiving endpoint when the frame's signature verified (``WIRE.md`` §7): an
    # unsigned frame it accepts anyway (a last will) arrives with ``False``. Never encoded.
    verified: bool = field(default=False, compare=False, repr=False)
    # Bytes the receiving endpoint counted for it (its frame, or its chunk frames), so that a
    # handler that refuses it can count them as refused (``Endpoint.refuse``). Never encoded.
    received: int = field(default=0, compare=False, repr=False)

    @property
    def kind(self) -> str:
        """The body's kind tag."""
        return type(self.body).KIND


def encode(env: Envelope) -> bytes:
    """Serialise ``env`` to its canonical unsigned frame."""
    frame = {
        "v": SCHEMA_VERSION,
        "k": env.kind,
        "f": env.federation,
        "s": env.sender,
        "i": env.msg_id,
        "r": env.round,
        "t": float(env.ts),
        "b": env.body.to_wire(),
    }
    return msgpack.packb(frame, use_bin_type=True)  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class FrameTemplate:
    """The unsigned frames of envelopes that are one envelope but for their message id and
    some top-level ``str`` fields of the body, made by splicing those strings into that
    envelope's frame instead of encoding each envelope anew.

    A step's tasks under broadcast differ only in ``task_id``: building and encoding each
    envelope costs ~35 us of a ~45 us task at 10,000 agents, a spliced frame ~2 us.
    The frames are byte-identical to :func:`encode`'s (msgpack strings delimit themselves and
    maps count entries, not bytes), and every frame keeps the prototype's timestamp: the
    burst's, within the second or so the burst takes.
    """

    parts: tuple[bytes, ...]  # the frame around the slots
    slots: tuple[int, ...]  # what goes between parts[k] and parts[k + 1]: 0 = msg id, j = field j
    # field j's default (None: it has none): a value equal to it is left out of encode's frame
    # (WIRE.md §3), so it cannot be spliced
    defaults: tuple[str | None, ...] = ()
    # one Packer per template (not thread-safe: a template is filled by one thread): `packb`
    # builds a Packer per call, ~4x the cost of packing a short string with one
    packer: msgpack.Packer = field(default_factory=msgpack.Packer, compare=False, repr=False)

    @classmethod
    def of(cls, env: Envelope, fields: tuple[str, ...]) -> FrameTemplate:
        """The template of ``env`` with its message id and the body's ``fields`` left open.

        A field with a default (an ack's ``task_id``) can be a slot; :meth:`fill` then
        refuses a value equal to that default, which ``encode`` would leave out of the frame.

        Raises:
            ValueError: a field is not a ``str`` field of the body, or a slot cannot be found
                exactly once in the frame.
        """
        marks = [f"slot{j}x{secrets.token_hex(16)}" for j in range(len(fields) + 1)]
        declared = {f.name: f for f in dataclasses.fields(env.body)}
        defaults: list[str | None] = [None]  # the message id has none
        for name in fields:
            spec = declared.get(name)
            if spec is None or not isinstance(getattr(env.body, name), str):
                raise ValueError(f"{env.kind}.{name}: not a str field of the body")
            default = spec.default
            defaults.append(default if isinstance(default, str) else None)
        body = replace(env.body, **dict(zip(fields, marks[1:], strict=True)))  # type: ignore[arg-type]
        frame = encode(replace(env, body=body, msg_id=marks[0], wire=b""))
        found = []
        for j, mark in enumerate(marks):
            packed = msgpack.packb(mark)
            at = frame.find(packed)
            if at < 0 or frame.find(packed, at + 1) >= 0:
                raise ValueError(f"{env.kind}: slot {j} not found exactly once in its frame")
            found.append((at, len(packed), j))
        found.sort()
        parts, start = [], 0
        for at, size, _j in found:
            parts.append(frame[start:at])
            start = at + size
        parts.append(frame[start:])
        return cls(tuple(parts), tuple(j for _at, _size, j in found), tuple(defaults))

    def fill(self, msg_id: str, *values: str) -> bytes:
        """The frame with ``msg_id`` and ``values`` (in the order of ``of``'s ``fields``).

        The values are spliced as they are: they come from bodies the caller built (and so
        validated), one frame per body.

        Raises:
            ValueError: the number of values is not the number of fields, or a value equals
                its field's default (encode that body instead: its frame omits the field).
        """
        given = (msg_id, *values)
        if len(given) != len(self.slots):
            raise ValueError(f"{len(self.slots) - 1} field values expected, got {len(values)}")
        for value, default in zip(given, self.defaults, strict=False):
            if value == default:
                raise ValueError(f"{value!r} is its field's default, which a frame leaves out")
        out, pack = [self.parts[0]], self.packer.pack
        for slot, part in zip(self.slots, self.parts[1:], strict=True):
            out.append(pack(given[slot]))
            out.append(part)
        return b"".join(out)


@functools.lru_cache(maxsize=16)
def _unpack_kwargs(limits: Limits) -> dict[str, int]:
    """``limits.unpack_kwargs()``, made once per (frozen, hashable) limits and only read."""
    return limits.unpack_kwargs()


def decode_frame_map(data: bytes, limits: Limits = Limits()) -> dict[str, Any]:
    """Unpack ``data`` into a map without interpreting it (used by signing and chunking)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"frame: expected bytes, got {type(data).__name__}")
    if len(data) > limits.max_message:
        raise LimitError(f"frame: {len(data)} bytes exceeds the {limits.max_message}-byte cap")
    try:
        obj = msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, **_unpack_kwargs(limits)
        )
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise DecodeError(f"frame: not a single msgpack value ({exc})") from exc
    except (ValueError, TypeError, UnicodeDecodeError, OverflowError, RecursionError) as exc:
        raise DecodeError(f"frame: malformed msgpack ({type(exc).__name__}: {exc})") from exc
    if not isinstance(obj, dict):
        raise DecodeError(f"frame: expected a map, got {type(obj).__name__}")
    if obj.get("v") != SCHEMA_VERSION:
        got = obj.get("v")
        raise DecodeError(f"frame.v: expected schema version {SCHEMA_VERSION}, got {got!r}")
    return obj


def decode(data: bytes, limits: Limits = Limits()) -> Envelope:
    """Parse and validate an unsigned frame. Signed frames go through
    ``protocol.security.signing``."""
    obj = decode_frame_map(data, limits)
    if "sm" in obj:
        raise DecodeError("frame: signed frame given to decode(); use a Verifier")
    return envelope_from_map(obj, wire=bytes(data))


_FRAME_KEYS = frozenset({"v", "k", "f", "s", "i", "r", "t", "b"})


def envelope_from_map(
    obj: dict[str, Any], *, wire: bytes = b"", fast: bool = True, received: int = 0
) -> Envelope:
    """Validate an unpacked unsigned frame map and build its :class:`Envelope`.

    ``wire``: the frame's bytes, kept on the envelope; ``received``: the bytes counted for
    it. ``fast=False`` forces the typed walk
    for the body; by default the kinds ``protocol.contract.lean`` knows (replies) try the lean
    decoder
    first, which returns a body only where the typed walk would build an equal one and leaves
    everything else, including every rejection and its message, to the typed walk.
    """
    if obj.keys() != _FRAME_KEYS:
        raise ValidationError("frame", f"keys {sorted(_FRAME_KEYS)}", sorted(map(str, obj)))
    kind = obj["k"]
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValidationError("frame.k", f"one of {sorted(MESSAGE_TYPES)}", kind)
    for key, name in (("f", "federation"), ("s", "sender"), ("i", "msg_id")):
        if not isinstance(obj[key], str) or not 0 < len(obj[key]) <= 128:
            want = "a string of 1..128 characters"
            raise ValidationError(f"frame.{key} ({name})", want, obj[key])
    if not isinstance(obj["r"], int) or isinstance(obj["r"], bool) or obj["r"] < 0:
        raise ValidationError("frame.r (round)", "a non-negative int", obj["r"])
    if not isinstance(obj["t"], float):
        raise ValidationError("frame.t (timestamp)", "float", type(obj["t"]).__name__)
    try:
        body: Any = lean.decode_body(kind, obj["b"]) if fast else None
        if body is None:
            body = cls.from_wire(obj["b"], kind)
    except ProtocolError:
        raise
    except (ValueError, TypeError, KeyError, OverflowError, IndexError, RecursionError) as exc:
        raise DecodeError(f"{kind}: {type(exc).__name__}: {exc}") from exc
    return Envelope(
        body=body,
        sender=obj["s"],
        federation=obj["f"],
        round=obj["r"],
        msg_id=obj["i"],
        ts=obj["t"],
        wire=wire,
        received=received,
    )
