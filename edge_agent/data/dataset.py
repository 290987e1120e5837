"""The in-memory image dataset every loader returns and every partition indexes into.

The module is numpy-only: conversion to tensors happens in the trainer, so loading and
partitioning data never imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from protocol.errors import ValidationError

__all__ = ["ArrayDataset", "resize_images"]


@dataclass(frozen=True)
class ArrayDataset:
    """Images and labels held in memory, validated once on construction.

    Treat the arrays as immutable: :meth:`subset` and the loaders always return new arrays.

    Attributes:
        x: Images, float32 ``[N, C, H, W]`` with every value in ``[0, 1]``.
        y: Labels, int64 ``[N]`` with every value in ``[0, num_classes)``.
        num_classes: Number of classes of the label space (classes may have no samples).
        class_names: One name per class, ``len(class_names) == num_classes``.
        name: Where the data came from, e.g. ``"digits"`` or ``"cifar10"``.
    """

    x: npt.NDArray[np.float32]
    y: npt.NDArray[np.int64]
    num_classes: int
    class_names: tuple[str, ...]
    name: str

    def __post_init__(self) -> None:
        _check_images(self.x)
        _check_labels(self.y, int(self.x.shape[0]), self.num_classes)
        if not isinstance(self.class_names, tuple) or not all(
            isinstance(c, str) for c in self.class_names
        ):
            raise ValidationError("class_names", "a tuple of str", self.class_names)
        if len(self.class_names) != self.num_classes:
            raise ValidationError(
                "class_names", f"{self.num_classes} names (one per class)", len(self.class_names)
            )
        if not isinstance(self.name, str) or not self.name:
            raise ValidationError("name", "a non-empty str", self.name)

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """The shape ``(C, H, W)`` of one image."""
        _, c, h, w = self.x.shape
        return int(c), int(h), int(w)

    def class_counts(self) -> npt.NDArray[np.int64]:
        """Samples per class, an int64 array of length ``num_classes``."""
        return np.bincount(self.y, minlength=self.num_classes).astype(np.int64)

    def subset(self, indices: npt.ArrayLike) -> ArrayDataset:
        """A new dataset holding the samples at ``indices`` (in that order, copied).

        Args:
            indices: A 1-D sequence of integer positions in ``[0, len(self))``.

        Raises:
            ValidationError: When ``indices`` is not 1-D integer or holds an out-of-range value.
        """
        idx = np.asarray(indices)
        if idx.size == 0:
            idx = idx.astype(np.int64)
        if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
            raise ValidationError("indices", "a 1-D integer array", f"{idx.dtype} {idx.shape}")
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise ValidationError(
                "indices", f"values in [0, {len(self)})", f"[{idx.min()}, {idx.max()}]"
            )
        return ArrayDataset(self.x[idx], self.y[idx], self.num_classes, self.class_names, self.name)

    def resized(self, image_size: int) -> ArrayDataset:
        """A copy with every image resized (bilinear) to ``image_size x image_size``."""
        x = resize_images(self.x, image_size)
        return ArrayDataset(x, self.y.copy(), self.num_classes, self.class_names, self.name)


def _check_images(x: object) -> None:
    if not isinstance(x, np.ndarray):
        raise ValidationError("x", "a numpy array", type(x).__name__)
    if x.dtype != np.float32:
        raise ValidationError("x.dtype", "float32", str(x.dtype))
    if x.ndim != 4 or min(x.shape[1:]) < 1:
        raise ValidationError("x.shape", "[N, C, H, W] with C, H, W >= 1", x.shape)
    if x.size:
        lo, hi = float(x.min()), float(x.max())
        # written so that NaN fails too
        if not (lo >= 0.0 and hi <= 1.0):
            raise ValidationError("x", "values in [0, 1] (scale images before building)", (lo, hi))


def _check_labels(y: object, n: int, num_classes: object) -> None:
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
        raise ValidationError("num_classes", "an int >= 1", num_classes)
    if not isinstance(y, np.ndarray):
        raise ValidationError("y", "a numpy array", type(y).__name__)
    if y.dtype != np.int64:
        raise ValidationError("y.dtype", "int64", str(y.dtype))
    if y.shape != (n,):
        raise ValidationError("y.shape", f"({n},) to match x", y.shape)
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValidationError("y", f"labels in [0, {num_classes})", f"[{y.min()}, {y.max()}]")


def resize_images(x: npt.NDArray[np.float32], image_size: int) -> npt.NDArray[np.float32]:
    """Bilinear resize of ``[N, C, H, W]`` images to ``image_size x image_size``.

    Matches ``torch.nn.functional.interpolate(mode="bilinear", align_corners=False)`` without
    antialiasing, computed with numpy as two small interpolation matrices.

    Args:
        x: float32 images ``[N, C, H, W]``.
        image_size: Output side length in pixels, ``>= 1``.

    Returns:
        float32 images ``[N, C, image_size, image_size]``, clipped to the input's range.
    """
    if not isinstance(image_size, int) or isinstance(image_size, bool) or image_size < 1:
        raise ValidationError("image_size", "an int >= 1", image_size)
    _, _, h, w = x.shape
    if (h, w) == (image_size, image_size):
        return np.array(x, dtype=np.float32)
    rows = _interp_matrix(h, image_size)  # [out, h]
    cols = _interp_matrix(w, image_size)  # [out, w]
    out = np.einsum("oh,nchw,pw->ncop", rows, x, cols, optimize=True)
    return np.asarray(np.clip(out, 0.0, 1.0), dtype=np.float32)


def _interp_matrix(size_in: int, size_out: int) -> npt.NDArray[np.float32]:
    """Row ``i`` holds the weights of the input pixels that make output pixel ``i``."""
    scale = size_in / size_out
    # half-pixel centres (align_corners=False), clamped at the borders as torch does
    src = np.maximum((np.arange(size_out) + 0.5) * scale - 0.5, 0.0)
    lo = np.minimum(np.floor(src).astype(np.int64), size_in - 1)
    hi = np.minimum(lo + 1, size_in - 1)
    frac = src - lo
    m = np.zeros((size_out, size_in), dtype=np.float64)
    out = np.arange(size_out)
    np.add.at(m, (out, lo), 1.0 - frac)
    np.add.at(m, (out, hi), frac)
    return m.astype(np.float32)


def class_names_for(num_classes: int, names: Sequence[str] | None = None) -> tuple[str, ...]:
    """``names`` as a tuple, or ``("0", "1", ...)`` when there are none."""
    if names is None:
        return tuple(str(i) for i in range(num_classes))
    return tuple(str(n) for n in names)
