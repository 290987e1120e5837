"""Low-rank (truncated SVD) compression of weight tensors on the wire (FedKD's, Wu et al. 2022).

A float tensor of shape ``(m, *rest)`` with ``m > 1`` is read as the matrix ``[m, n]``,
``n = prod(rest)``, and replaced by its truncated SVD when that is smaller: the smallest rank
``r`` whose singular values keep at least ``energy`` of the squared Frobenius norm. In a
:class:`TensorMap` the factors travel as four tensors next to the uncompressed ones::

    NAME#u      float [m, r]      left singular vectors
    NAME#s      float [r]         singular values
    NAME#v      float [r, n]      right singular vectors
    NAME#shape  int   [ndim]      the original shape

``#`` never occurs in PyTorch parameter names, so a factor can never be mistaken for a tensor.
Convolution kernels are factorised as ``[out, in * kh * kw]`` (the usual low-rank layer
factorisation); HtFLlib's FedKD instead takes a batched SVD over the last two dimensions, which
for 3x3 kernels saves nothing. Integer tensors and vectors travel as they are.

:func:`restore` is peer input handling: every factor set is checked (all four parts, 2-D/1-D
shapes that agree, ``1 <= r <= min(m, n)``, a positive shape whose size is ``m * n`` and below
:data:`MAX_ELEMENTS`) before anything is multiplied.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from protocol.contract.payloads import TensorMap
from protocol.errors import ValidationError

__all__ = ["MAX_ELEMENTS", "PARTS", "compress", "is_compressed", "restore"]

PARTS = ("u", "s", "v", "shape")
SEP = "#"
MAX_ELEMENTS = 1 << 26  # one restored tensor: 64 Mi elements (256 MiB float32)
F32_MAX = float(np.finfo(np.float32).max)


def _rank_for(s: npt.NDArray[np.float64], energy: float) -> int:
    """The smallest r with sum(s[:r]^2) >= energy * sum(s^2) (s sorted descending)."""
    sq = np.square(s)
    cumulative = np.cumsum(sq)
    return int(np.searchsorted(cumulative, energy * cumulative[-1] * (1 - 1e-12)) + 1)


def _factorise(
    value: npt.NDArray[np.float32], energy: float
) -> dict[str, npt.NDArray[np.generic]] | None:
    """The factors of ``value`` at ``energy``, or ``None`` when they would not be smaller.

    The SVD comes from the eigendecomposition of the Gram matrix of the shorter side: a
    ``k x k`` problem (``k = min(m, n)``) in place of an ``m x n`` SVD, 3-6x less CPU (5.7x
    for a 512 x 4608 layer, ``benchmarks/bench_protocol.py --sections lowrank``), and the
    spectrum alone decides, before any vector is formed, whether factors would be smaller.
    Squaring loses only singular values below about 1e-8 of the largest: their shares of the
    squared norm (under 1e-16 each) lie in the 1e-12 tail that the rank search leaves out.
    """
    m, n = value.shape[0], math.prod(value.shape[1:])
    matrix = value.reshape(m, n).astype(np.float64)
    if not np.any(matrix):
        return None
    wide = m <= n
    eigval, eigvec = np.linalg.eigh(matrix @ matrix.T if wide else matrix.T @ matrix)
    s = np.sqrt(np.clip(eigval[::-1], 0.0, None))  # descending
    r = min(_rank_for(s, energy), s.size)
    if r * (m + n + 1) + value.ndim >= m * n:
        return None
    kept, sr = eigvec[:, ::-1][:, :r], s[:r]
    if wide:  # kept = U[:, :r]; V^T = S^-1 U^T A
        u, vt = kept, (kept.T @ matrix) / sr[:, None]
    else:  # kept = V[:, :r]; U = A V S^-1
        u, vt = (matrix @ kept) / sr, kept.T
    return {
        "u": u.astype(np.float32),
        "s": sr.astype(np.float32),
        "v": vt.astype(np.float32),
        "shape": np.asarray(value.shape, dtype=np.int64),
    }


def compress(weights: TensorMap, energy: float) -> TensorMap:
    """``weights`` with every float tensor of >= 2 dimensions (first > 1) that a rank-``r``
    SVD keeping ``energy`` (0 < energy <= 1) of its squared norm makes smaller factorised."""
    if not 0 < energy <= 1:
        raise ValueError(f"energy must be in (0, 1], got {energy}")
    out: dict[str, npt.NDArray[np.generic]] = {}
    for name, value in weights.tensors.items():
        factors = None
        if value.dtype.kind == "f" and value.ndim >= 2 and value.shape[0] > 1:
            factors = _factorise(value, energy)
        if factors is None:
            out[name] = value
        else:
            out.update({f"{name}{SEP}{part}": arr for part, arr in factors.items()})
    return TensorMap(out, encoding=weights.encoding)


def is_compressed(weights: TensorMap) -> bool:
    """Whether any tensor of ``weights`` is a low-rank factor."""
    return any(SEP in name for name in weights.tensors)


def _factor_sets(weights: TensorMap, where: str) -> dict[str, dict[str, npt.NDArray[np.generic]]]:
    sets: dict[str, dict[str, npt.NDArray[np.generic]]] = {}
    for name, value in weights.tensors.items():
        if SEP not in name:
            continue
        base, _, part = name.rpartition(SEP)
        if part not in PARTS or not base or SEP in base:
            raise ValidationError(f"{where}.{name}", f"NAME{SEP}one of {PARTS}", name)
        sets.setdefault(base, {})[part] = value
    for base, parts in sets.items():
        missing = [p for p in PARTS if p not in parts]
        if missing:
            raise ValidationError(f"{where}.{base}", f"all of {PARTS}", f"missing {missing}")
        if base in weights.tensors:
            raise ValidationError(f"{where}.{base}", "either the tensor or its factors", "both")
    return sets


def _checked_shape(parts: dict[str, npt.NDArray[np.generic]], where: str) -> tuple[int, ...]:
    """The original shape, after checking that the factors agree with it."""
    u, s, v, shape = (parts[p] for p in PARTS)
    if shape.dtype.kind != "i" or shape.ndim != 1 or shape.size < 2 or shape.min() < 1:
        raise ValidationError(f"{where}{SEP}shape", "2+ positive sizes", shape.tolist())
    dims = tuple(int(d) for d in shape)
    size = math.prod(dims)
    if size > MAX_ELEMENTS:
        raise ValidationError(f"{where}{SEP}shape", f"at most {MAX_ELEMENTS} elements", size)
    m, n = dims[0], size // dims[0]
    if s.ndim != 1 or not 1 <= s.size <= min(m, n):
        raise ValidationError(f"{where}{SEP}s", f"rank 1..{min(m, n)}", list(s.shape))
    r = s.size
    if u.shape != (m, r):
        raise ValidationError(f"{where}{SEP}u", f"shape [{m}, {r}]", list(u.shape))
    if v.shape != (r, n):
        raise ValidationError(f"{where}{SEP}v", f"shape [{r}, {n}]", list(v.shape))
    return dims


def restore(weights: TensorMap, where: str = "weights") -> TensorMap:
    """The full tensors of ``weights`` (factor sets multiplied out, the rest as received).

    Raises:
        ValidationError: an incomplete or inconsistent factor set, named by ``where``.
    """
    sets = _factor_sets(weights, where)
    if not sets:
        return weights
    out = {name: value for name, value in weights.tensors.items() if SEP not in name}
    for base, parts in sets.items():
        dims = _checked_shape(parts, f"{where}.{base}")
        u, s, v = (parts[p].astype(np.float64) for p in ("u", "s", "v"))
        product = (u * s) @ v
        if not np.all(np.abs(product) <= F32_MAX):
            raise ValidationError(f"{where}.{base}", "a product within float32", "overflow")
        out[base] = product.reshape(dims).astype(np.float32)
    return TensorMap(out, encoding=weights.encoding)
