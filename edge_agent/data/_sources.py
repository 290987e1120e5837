"""File-backed sources: torchvision's dataset files, image folders and raw arrays.

torchvision and PIL are imported lazily, only when one of these sources is asked for, and
torchvision is always constructed with ``download=False``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from edge_agent.data.dataset import ArrayDataset, class_names_for
from protocol.errors import ConfigError

__all__ = [
    "TORCHVISION",
    "TorchvisionSource",
    "dataset_from_arrays",
    "images_from_array",
    "load_image_folder",
    "load_torchvision",
]

_MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
_GREY_MODES = frozenset({"1", "L"})
_SPLITS = {"train": (True,), "test": (False,), "all": (True, False)}


@dataclass(frozen=True)
class TorchvisionSource:
    """Where torchvision expects one dataset's files under ``root`` (all of them are checked).

    Attributes:
        cls: Class name in ``torchvision.datasets``.
        folder: Directory under ``root`` that holds the files.
        files: File names torchvision checks before it loads either split.
        archive: The archive the files come from, named in the error message.
    """

    cls: str
    folder: str
    files: tuple[str, ...]
    archive: str


TORCHVISION: dict[str, TorchvisionSource] = {
    "mnist": TorchvisionSource(
        "MNIST", "MNIST/raw", _MNIST_FILES, "the four MNIST idx files (gunzipped)"
    ),
    "fashion_mnist": TorchvisionSource(
        "FashionMNIST",
        "FashionMNIST/raw",
        _MNIST_FILES,
        "the four Fashion-MNIST idx files (gunzipped)",
    ),
    "cifar10": TorchvisionSource(
        "CIFAR10",
        "cifar-10-batches-py",
        (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta"),
        "cifar-10-python.tar.gz (extracted)",
    ),
    "cifar100": TorchvisionSource(
        "CIFAR100",
        "cifar-100-python",
        ("train", "test", "meta"),
        "cifar-100-python.tar.gz (extracted)",
    ),
}


def load_torchvision(key: str, split: str, root: Path | None) -> ArrayDataset:
    """Load a torchvision dataset from files already under ``root``; never downloads.

    Args:
        key: A key of :data:`TORCHVISION`.
        split: ``"train"``, ``"test"`` or ``"all"`` (train then test).
        root: The directory given as ``--data-root``.

    Raises:
        ConfigError: No root, an unknown split, missing files or files torchvision rejects.
    """
    source = TORCHVISION[key]
    if split not in _SPLITS:
        raise ConfigError(
            f"dataset {key!r}: unknown split {split!r}; use {key}:train, {key}:test or {key}:all"
        )
    if root is None:
        raise ConfigError(
            f"dataset {key!r} is read from local files: pass a data root "
            f"(--data-root) whose {source.folder}/ holds {', '.join(source.files)}"
        )
    folder = root / source.folder
    missing = [name for name in source.files if not (folder / name).is_file()]
    if missing:
        raise ConfigError(
            f"dataset {key!r}: missing {', '.join(missing)} in {folder} (expected there: "
            f"{', '.join(source.files)}, i.e. {source.archive}); nothing is downloaded, "
            "copy the files there first"
        )
    try:
        import torchvision.datasets as tvd
    except ImportError as exc:
        raise ConfigError(f"dataset {key!r} needs torchvision: pip install edgefl") from exc
    parts = []
    for train in _SPLITS[split]:
        try:
            parts.append(getattr(tvd, source.cls)(str(root), train=train, download=False))
        except (RuntimeError, OSError, ValueError) as exc:
            raise ConfigError(
                f"dataset {key!r}: torchvision rejected the files in {folder} "
                f"({exc}); nothing is downloaded"
            ) from exc
    x = np.concatenate([_as_nchw_uint8(np.asarray(p.data)) for p in parts])
    y = np.concatenate([np.asarray(p.targets, dtype=np.int64) for p in parts])
    names = class_names_for(len(parts[0].classes), parts[0].classes)
    name = key if split == "train" else f"{key}:{split}"
    return ArrayDataset(_scale_uint8(x), y, len(names), names, name)


def _as_nchw_uint8(x: npt.NDArray[Any]) -> npt.NDArray[np.uint8]:
    # MNIST-style data is [N, H, W]; CIFAR's is [N, H, W, C]
    if x.ndim == 3:
        return x[:, None].astype(np.uint8)
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2)).astype(np.uint8)


def _scale_uint8(x: npt.NDArray[np.uint8]) -> npt.NDArray[np.float32]:
    out = np.asarray(x, dtype=np.float32)
    out /= np.float32(255.0)
    return out


def load_image_folder(path: Path, image_size: int | None) -> ArrayDataset:
    """Read every image under ``path/CLASS/`` (torchvision's ImageFolder layout).

    Images become greyscale when every file is greyscale and RGB otherwise, and are resized
    (bilinear, PIL) to ``image_size`` when given; without it all images must share one size.

    Raises:
        ConfigError: The directory is missing, holds no images, or sizes differ.
    """
    if not path.is_dir():
        raise ConfigError(f"image folder {path} is not a directory")
    try:
        from PIL import Image
        from torchvision.datasets import ImageFolder
    except ImportError as exc:
        raise ConfigError("image folders need torchvision and Pillow: pip install edgefl") from exc
    try:
        folder = ImageFolder(str(path))
    except (FileNotFoundError, OSError) as exc:
        raise ConfigError(
            f"image folder {path}: {exc} (expected {path}/CLASS/IMAGE files)"
        ) from exc
    images = []
    for file, _ in folder.samples:
        try:
            with Image.open(file) as img:
                img.load()
                images.append(img.copy())
        except OSError as exc:  # includes PIL.UnidentifiedImageError
            raise ConfigError(f"image folder {path}: cannot read image {file}: {exc}") from exc
    mode = "L" if all(img.mode in _GREY_MODES for img in images) else "RGB"
    if image_size is not None:
        size = (image_size, image_size)
        images = [img.resize(size, Image.Resampling.BILINEAR) for img in images]
    sizes = {img.size for img in images}
    if len(sizes) > 1:
        raise ConfigError(
            f"image folder {path}: images have {len(sizes)} different sizes "
            f"(e.g. {sorted(sizes)[:3]}); pass image_size to resize them"
        )
    arrays = [np.asarray(img.convert(mode), dtype=np.uint8) for img in images]
    x = _as_nchw_uint8(np.stack(arrays)) if mode == "RGB" else np.stack(arrays)[:, None]
    y = np.asarray([label for _, label in folder.samples], dtype=np.int64)
    names = tuple(folder.classes)
    return ArrayDataset(_scale_uint8(x), y, len(names), names, f"imagefolder:{path.name}")


def dataset_from_arrays(arrays: Mapping[str, npt.NDArray[Any]], name: str) -> ArrayDataset:
    """Build a dataset from raw ``x``/``y``/``class_names`` arrays, as stored in an ``.npz``.

    Raises:
        ValueError: A key is missing or an array has the wrong kind, shape or range.
    """
    unknown = sorted(set(arrays) - {"x", "y", "class_names"})
    missing = [key for key in ("x", "y") if key not in arrays]
    if missing or unknown:
        raise ValueError(
            f"expected arrays x, y and optionally class_names; missing {missing}, "
            f"unexpected {unknown}"
        )
    x = images_from_array(arrays["x"])
    y = _labels(arrays["y"], int(x.shape[0]))
    if "class_names" in arrays:
        raw = arrays["class_names"]
        if raw.ndim != 1 or raw.dtype.kind not in "US":
            raise ValueError(f"class_names must be a 1-D string array, got {raw.dtype} {raw.shape}")
        names = class_names_for(len(raw), [str(n) for n in raw.tolist()])
    else:
        names = class_names_for(int(y.max()) + 1 if y.size else 1)
    if y.size and int(y.max()) >= len(names):
        raise ValueError(f"label {int(y.max())} has no class name ({len(names)} class_names)")
    return ArrayDataset(x, y, len(names), names, name)


def images_from_array(x: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    """float32 ``[N, C, H, W]`` in [0, 1] from uint8 or [0, 1] float ``NHW``, ``NCHW`` or ``NHWC``.

    Raises:
        ValueError: Another rank, no channel axis of size 1, 3 or 4, dtype or value range.
    """
    return _images_to_float(_to_nchw(x))


def _to_nchw(x: npt.NDArray[Any]) -> npt.NDArray[Any]:
    if x.ndim == 3:
        return x[:, None]
    if x.ndim != 4:
        raise ValueError(f"x must be [N, H, W], [N, C, H, W] or [N, H, W, C], got shape {x.shape}")
    channels = (1, 3, 4)
    if x.shape[-1] in channels and x.shape[1] not in channels:
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    if x.shape[1] not in channels:
        raise ValueError(
            f"x shape {x.shape}: cannot find a channel axis of size 1, 3 or 4 "
            "(at position 1 for NCHW or last for NHWC)"
        )
    return x


def _images_to_float(x: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    if x.dtype == np.uint8:
        return _scale_uint8(x)
    if x.dtype.kind != "f":
        raise ValueError(f"x must be uint8 (0..255) or float in [0, 1], got dtype {x.dtype}")
    out = x.astype(np.float32)
    if out.size and not (float(out.min()) >= 0.0 and float(out.max()) <= 1.0):
        raise ValueError(f"float x must lie in [0, 1], got [{out.min()}, {out.max()}]")
    return out


def _labels(y: npt.NDArray[Any], n: int) -> npt.NDArray[np.int64]:
    if y.dtype.kind not in "iu":
        raise ValueError(f"y must hold integers, got dtype {y.dtype}")
    if y.shape != (n,):
        raise ValueError(f"y must have shape ({n},) to match x, got {y.shape}")
    if y.size and int(y.min()) < 0:
        raise ValueError(f"labels must be >= 0, got {int(y.min())}")
    return y.astype(np.int64)
