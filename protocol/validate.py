"""Small validators shared by the wire dataclasses' ``__post_init__`` checks."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from protocol.errors import ValidationError

__all__ = ["as_array", "check_class_ids", "check_finite", "check_shape"]


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
