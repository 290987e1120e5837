"""Small validators shared by the wire dataclasses' ``__post_init__`` checks, and the value
bounds the coordinator applies to replies (finite is not enough: ``docs/concepts/security.md``)."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from protocol.errors import ValidationError

__all__ = [
    "MAX_ABS_FEATURE",
    "MAX_ABS_WEIGHT",
    "as_array",
    "check_class_ids",
    "check_finite",
    "check_max_abs",
    "check_shape",
    "float_arrays",
    "sum_of_squares",
]

#: Largest |value| accepted in features a model computes and sends: prototypes, mean features,
#: logits, SD vectors. Honest models produce values of order 1 to 100 (BatchNorm'd, clipped,
#: L2-regularised training); 1e4 leaves two orders of magnitude of headroom while squares of
#: such values summed over any batch and feature size stay far inside float32 (max ~3.4e38),
#: so one accepted reply can never push a loss to infinity.
MAX_ABS_FEATURE = 1e4
#: Largest |value| accepted in model tensors (weights, BatchNorm running statistics).
MAX_ABS_WEIGHT = 1e6


def as_array(value: Any, dtype: str, field: str) -> npt.NDArray[Any]:
    """Coerce ``value`` to a C-contiguous array of ``dtype`` (numbers only, never objects)."""
    arr = np.asarray(value)
    if arr.dtype == object or arr.dtype.kind not in "biuf":
        raise ValidationError(field, f"numeric array castable to {dtype}", arr.dtype.str)
    target = np.dtype(dtype)
    if target.kind in "iu" and arr.dtype.kind == "f":
        raise ValidationError(field, f"integer array ({dtype})", arr.dtype.str)
    return np.asarray(arr, dtype=target, order="C")  # keeps 0-d (ascontiguousarray would not)


def check_shape(arr: npt.NDArray[Any], shape: tuple[int | None, ...], field: str) -> None:
    """Require ``arr.shape`` to match ``shape`` (``None`` matches any size)."""
    pairs = zip(shape, arr.shape, strict=False)  # lengths compared first
    if arr.ndim != len(shape) or any(s is not None and s != a for s, a in pairs):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValidationError(field, f"shape {want}", list(arr.shape))


def check_finite(arr: npt.NDArray[Any], field: str) -> None:
    """Reject NaN and infinities."""
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        bad = int((~np.isfinite(arr)).sum())
        raise ValidationError(field, "finite values", f"{bad} NaN/inf entries")


def check_class_ids(ids: npt.NDArray[Any], field: str, num_classes: int | None = None) -> None:
    """Class ids are unique, non-negative and, when known, below ``num_classes``."""
    if ids.size and int(ids.min()) < 0:
        raise ValidationError(field, "non-negative class ids", int(ids.min()))
    if num_classes is not None and ids.size and int(ids.max()) >= num_classes:
        raise ValidationError(field, f"class ids < {num_classes}", int(ids.max()))
    if np.unique(ids).size != ids.size:
        raise ValidationError(field, "unique class ids", ids.tolist())


# An overflowing sum of squares is an expected outcome of sum_of_squares' callers' shortcuts
# (they then take their exact path); numpy would print a RuntimeWarning for it
warnings.filterwarnings("ignore", "overflow encountered in matmul", RuntimeWarning, __name__)


#: unit roundoff of the dtypes whose dot product is a BLAS call
_ROUNDOFF = {np.dtype(np.float32): 2.0**-24, np.dtype(np.float64): 2.0**-53}


def sum_of_squares(arr: npt.NDArray[Any]) -> float:
    """The sum of the squares of every value: one BLAS reduction, no temporary array. NaN and
    inf propagate to it, and values beyond ~1e19 (float32) overflow it to inf, without a
    warning: a shortcut that finds it not finite takes its exact path.

    ``flat @ flat``, not ``np.dot``: both are the same BLAS dot, but ``np.dot`` releases the
    GIL around it, and winning the GIL back from a busy thread took a switch interval. Beside
    a thread spinning in Python, ``np.dot`` of 2,048 float32 averaged 1.28 ms and ``@`` 1.7 us
    (numpy 2.4); in the coordinator its network and engine threads check every reply.
    """
    flat = arr.reshape(-1)
    return float(flat @ flat) if flat.size else 0.0


def check_max_abs(arr: npt.NDArray[Any], bound: float, field: str) -> None:
    """Reject float values whose magnitude exceeds ``bound`` (NaN counts as exceeding)."""
    if arr.dtype.kind != "f" or not arr.size:
        return
    # fastest path, one BLAS reduction: max x^2 <= sum x^2, so a sum of squares within the
    # bound squared clears every value. The computed sum is within gamma_n = n u / (1 - n u)
    # of the true one (u: the dtype's unit roundoff, any summation order), so the test leaves
    # that margin; NaN, inf and an overflowing sum fail it and take the next path
    u = _ROUNDOFF.get(arr.dtype)
    if u is not None:
        nu = arr.size * u
        if nu < 0.5 and sum_of_squares(arr) <= (1 - nu / (1 - nu)) * bound * bound:
            return
    # fast path, same verdict: without NaN, max(max, -min) is nanmax(abs) (two reductions, no
    # temporary array); any NaN makes it NaN, which fails the test and takes the full path
    if max(float(arr.max()), -float(arr.min())) <= bound:
        return
    # any NaN refuses the array (np.nanmax would skip NaN beside other values and pass
    # [1.0, nan]; tests/protocol/contract/test_validate_bounds.py holds that case)
    peak = float("nan") if np.isnan(arr).any() else float(np.abs(arr).max())
    if not peak <= bound:  # also catches NaN
        raise ValidationError(field, f"|value| <= {bound:.0f}", f"|value| up to {peak:.3g}")


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    """A dataclass's field names (``dataclasses.fields`` per reply costs ~10 % of its checks)."""
    return tuple(f.name for f in dataclasses.fields(cls))


def float_arrays(payload: object, prefix: str) -> Iterator[tuple[str, npt.NDArray[Any]]]:
    """Every float array of a payload dataclass, with its field path (dict values included)."""
    if not dataclasses.is_dataclass(payload):
        return
    cls: type = type(payload)
    for name in _field_names(cls):
        value = getattr(payload, name)
        if isinstance(value, np.ndarray):  # the common case first: no list, one test a field
            if value.dtype.kind == "f":
                yield f"{prefix}.{name}", value
        elif isinstance(value, dict):
            for key, arr in value.items():
                if isinstance(arr, np.ndarray) and arr.dtype.kind == "f":
                    yield f"{prefix}.{name}.{key}", arr
