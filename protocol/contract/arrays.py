"""Language-neutral array encoding: dtype from an allow-list, shape, little-endian C-order bytes.

Wire form (a msgpack map)::

    {"dt": "<f4", "sh": [m, p], "d": <bytes>}                   # exact
    {"dt": "<f2", "sh": [...], "d": <bytes>, "as": "<f4"}        # float16 transport
    {"dt": "|i1", "sh": [...], "d": <bytes>, "as": "<f4",
     "sc": scale, "zp": zero_point}                              # int8 affine: x = (q - zp) * sc
    {"dt": "|u1", "sh": [...], "d": <bytes>, "as": "<f4",
     "sc": 1/255, "zp": 0}                                       # uint8 for values in [0, 1]

Lossy encodings apply to floating-point arrays only; the receiver always gets float32 back.
Decoders accept any affine ``sc``/``zp``; this encoder writes symmetric int8 (``zp = 0``) with
``sc`` rounded up to 16 significant bits. That makes every lossy encoding idempotent: decoding
and re-encoding reproduces the same bytes (products of a 9-bit integer and a 16-bit scale are
exact in float32), so relaying a message never drifts and test vectors are byte-exact.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from protocol.errors import LimitError, ValidationError

__all__ = [
    "ALLOWED_DTYPES",
    "ENCODINGS",
    "Encoding",
    "decode_array",
    "encode_array",
]

Encoding = Literal["raw", "f16", "i8", "u8"]
ENCODINGS: tuple[str, ...] = ("raw", "f16", "i8", "u8")

# dtype strings as numpy spells them in little-endian form; nothing else ever crosses the wire
ALLOWED_DTYPES: frozenset[str] = frozenset({"<f4", "<f2", "<i4", "<i8", "|u1", "|i1", "|b1"})
MAX_NDIM = 8


def _wire_dtype(a: npt.NDArray[Any], field: str) -> np.dtype[Any]:
    dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
    if dt.str not in ALLOWED_DTYPES:
        raise ValidationError(field, f"array dtype in {sorted(ALLOWED_DTYPES)}", dt.str)
    return dt


def encode_array(
    a: npt.NDArray[Any], encoding: Encoding = "raw", field: str = "array"
) -> dict[str, Any]:
    """Encode ``a`` as a wire map, applying ``encoding`` when ``a`` is floating point."""
    if a.dtype.kind == "f" and encoding != "raw":
        return _encode_lossy(np.asarray(a, dtype=np.float32), encoding, field)
    dt = _wire_dtype(a, field)
    data = np.ascontiguousarray(a, dtype=dt).tobytes()
    return {"dt": dt.str, "sh": list(a.shape), "d": data}


def _encode_lossy(a: npt.NDArray[np.float32], encoding: Encoding, field: str) -> dict[str, Any]:
    shape = list(a.shape)
    if not np.isfinite(a).all():
        raise ValidationError(field, f"finite values for {encoding} encoding", "NaN/inf entries")
    if encoding == "f16":
        with np.errstate(over="ignore"):  # overflow is reported below, with the field name
            h = a.astype("<f2")
        if not np.isfinite(h).all():  # |x| > 65504 overflows to inf, which receivers reject
            amax = float(np.abs(a).max())
            raise ValidationError(field, "|values| <= 65504 for f16 encoding", amax)
        return {"dt": "<f2", "sh": shape, "d": h.tobytes(), "as": "<f4"}
    if encoding == "u8":
        if a.size and (float(a.min()) < 0.0 or float(a.max()) > 1.0):
            raise ValidationError(
                field,
                "values in [0, 1] for u8 encoding",
                f"range [{float(a.min())}, {float(a.max())}]",
            )
        q = np.rint(a * 255.0).astype(np.uint8)
        return {"dt": "|u1", "sh": shape, "d": q.tobytes(), "as": "<f4", "sc": 1.0 / 255.0, "zp": 0}
    if encoding == "i8":
        scale = _i8_scale(float(np.abs(a).max()) if a.size else 0.0)
        q = np.clip(np.rint(a / np.float32(scale)), -127, 127).astype(np.int8)
        return {"dt": "|i1", "sh": shape, "d": q.tobytes(), "as": "<f4", "sc": scale, "zp": 0}
    raise ValidationError(field, f"encoding in {ENCODINGS}", encoding)


_SCALE_BITS = 16
_MIN_SCALE = 2.0**-100  # well inside float32's normal range, so scale * q stays exact


def _i8_scale(amax: float) -> float:
    """``amax / 127`` rounded *up* to 16 significant bits (exact in float32; see module doc)."""
    if amax <= _MIN_SCALE / 2:
        return 1.0  # every value quantises to 0: use the canonical scale of an all-zero array
    mantissa, exponent = math.frexp(max(amax / 127.0, _MIN_SCALE))
    step = 2.0**_SCALE_BITS
    return math.ldexp(math.ceil(mantissa * step) / step, exponent)


def decode_array(obj: Any, field: str = "array", max_bytes: int = 1 << 30) -> npt.NDArray[Any]:
    """Decode a wire map into a writable numpy array, validating every part of it."""
    if not isinstance(obj, dict):
        raise ValidationError(field, "array map", type(obj).__name__)
    unknown = set(obj) - {"dt", "sh", "d", "as", "sc", "zp"}
    if unknown:
        raise ValidationError(field, "keys among dt, sh, d, as, sc, zp", sorted(map(str, unknown)))
    dt, shape, data = obj.get("dt"), obj.get("sh"), obj.get("d")
    if not isinstance(dt, str) or dt not in ALLOWED_DTYPES:
        raise ValidationError(f"{field}.dt", f"one of {sorted(ALLOWED_DTYPES)}", dt)
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise ValidationError(f"{field}.sh", f"list of at most {MAX_NDIM} ints", shape)
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise ValidationError(f"{field}.sh", "non-negative ints", shape)
    if not isinstance(data, bytes):
        raise ValidationError(f"{field}.d", "bytes", type(data).__name__)
    dtype = np.dtype(dt)
    count = 1
    for s in shape:
        count *= s
        if count * dtype.itemsize > max_bytes:
            raise LimitError(f"{field}: array of shape {shape} exceeds {max_bytes} bytes")
    if count * dtype.itemsize != len(data):
        want = f"{count * dtype.itemsize} bytes for {dt}{shape}"
        raise ValidationError(f"{field}.d", want, len(data))
    arr = np.frombuffer(data, dtype=dtype).reshape(shape)
    target = obj.get("as")
    if target is None:
        return arr.astype(dtype.newbyteorder("="), copy=True)  # writable, native order
    return _dequantize(arr, obj, field)


def _dequantize(arr: npt.NDArray[Any], obj: dict[str, Any], field: str) -> npt.NDArray[np.float32]:
    if obj["as"] != "<f4":
        raise ValidationError(f"{field}.as", "'<f4'", obj["as"])
    if arr.dtype.kind == "f":
        if "sc" in obj or "zp" in obj:
            raise ValidationError(field, "no sc/zp for a float array", sorted(obj))
        return arr.astype(np.float32)
    if arr.dtype.kind not in "iu":
        raise ValidationError(f"{field}.dt", "an integer dtype when quantised", arr.dtype.str)
    sc, zp = obj.get("sc"), obj.get("zp")
    if not isinstance(sc, float) or not np.isfinite(sc) or sc <= 0:
        raise ValidationError(f"{field}.sc", "a positive finite float", sc)
    if not isinstance(zp, int) or isinstance(zp, bool) or not -256 <= zp <= 255:
        raise ValidationError(f"{field}.zp", "an int in [-256, 255]", zp)
    out: npt.NDArray[np.float32] = (arr.astype(np.float32) - np.float32(zp)) * np.float32(sc)
    return out.astype(np.float32, copy=False)
