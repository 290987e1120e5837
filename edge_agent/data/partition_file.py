"""A split as a file: per-client index arrays over a dataset the toolkit loads (``.npz``).

The format other toolkits can write and read (HtFLlib, PFLlib and hand-made splits)::

    train_idx_<k>    int array, client k's training samples (k = 0..K-1, every k present)
    test_idx_<k>     int array, client k's local test samples
    global_test_idx  int array, optional: a global test set disjoint from every client's data;
                     without it, the global test set is the union of the clients' test sets
                     (HtFLlib's and PFLlib's splits hold out nothing else)
    spec_json        optional 0-d string: how the split was made (written by our export)

Indices are positions in the dataset as :func:`~edge_agent.data.load_dataset` returns it.
Every index lies in ``[0, N)`` and appears in at most one array: a sample that is both one
client's training and another's test sample would inflate every accuracy. Any other array is
named in a warning and ignored. Loading never unpickles (``allow_pickle=False``).
"""

from __future__ import annotations

import json
import logging
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from edge_agent.data.partition import IndexArray
from edge_agent.data.spec import PartitionSpec
from edge_agent.data.split import FederatedSplit
from protocol.errors import ConfigError

__all__ = [
    "PartitionFile",
    "global_test_of",
    "load_partition_file",
    "save_partition_file",
    "split_from_file",
]

_CLIENT_KEY = re.compile(r"(train|test)_idx_(0|[1-9][0-9]*)")
GLOBAL_KEY = "global_test_idx"
SPEC_KEY = "spec_json"
_log = logging.getLogger("edgefl.data")


@dataclass(frozen=True)
class PartitionFile:
    """The index sets of a split file, checked against each other (not yet against a dataset).

    Attributes:
        path: Where it was read from.
        train: Per client, sorted training indices.
        test: Per client, sorted local test indices.
        global_test: Sorted global test indices (empty when the file has none).
        spec: What the file says about how it was made (``spec_json``), if anything.
    """

    path: Path
    train: tuple[IndexArray, ...]
    test: tuple[IndexArray, ...]
    global_test: IndexArray
    spec: dict[str, Any]

    @property
    def num_clients(self) -> int:
        """Number of clients in the file."""
        return len(self.train)

    def check_dataset(self, size: int, name: str) -> None:
        """Every index must address one of the dataset's ``size`` samples.

        Raises:
            ConfigError: naming the array, the offending index and the dataset size.
        """
        for key, arr in self._arrays():
            if arr.size and int(arr.max()) >= size:
                raise ConfigError(
                    f"partition file {self.path}: {key} holds index {int(arr.max())}, but "
                    f"dataset {name!r} has {size} samples (valid: 0..{size - 1})"
                )

    def check_clients(self, num_clients: int) -> None:
        """The fleet must have as many clients as the file.

        Raises:
            ConfigError: the counts differ.
        """
        if num_clients != self.num_clients:
            raise ConfigError(
                f"partition file {self.path} holds {self.num_clients} clients "
                f"(train_idx_0..train_idx_{self.num_clients - 1}), but the fleet has "
                f"{num_clients}; give as many agents as the file has clients"
            )

    def _arrays(self) -> list[tuple[str, IndexArray]]:
        out = [(f"train_idx_{k}", a) for k, a in enumerate(self.train)]
        out += [(f"test_idx_{k}", a) for k, a in enumerate(self.test)]
        return [*out, (GLOBAL_KEY, self.global_test)]


def save_partition_file(path: str | Path, split: FederatedSplit) -> Path:
    """Write ``split`` in the file format (``spec_json`` records the dataset and the spec).

    Returns:
        The path written (``.npz`` appended when missing, as numpy does).
    """
    out = Path(path)
    if out.suffix != ".npz":
        out = out.with_name(out.name + ".npz")
    arrays: dict[str, npt.NDArray[Any]] = {}
    for k in range(split.num_clients):
        arrays[f"train_idx_{k}"] = np.asarray(split.client_train_indices[k], np.int64)
        arrays[f"test_idx_{k}"] = np.asarray(split.client_test_indices[k], np.int64)
    arrays[GLOBAL_KEY] = np.asarray(split.global_test_indices, np.int64)
    meta = {
        "dataset": split.dataset.name,
        "num_samples": len(split.dataset),
        "spec": None if split.spec is None else split.spec.to_dict(),
    }
    arrays[SPEC_KEY] = np.asarray(json.dumps(meta, sort_keys=True))
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, **arrays)  # type: ignore[arg-type]
    return out


def load_partition_file(path: str | Path, num_clients: int | None = None) -> PartitionFile:
    """Read and check a split file; ``num_clients`` (when given) must equal the file's.

    Raises:
        ConfigError: unreadable file, a missing ``train_idx_k``/``test_idx_k``, a non-integer
            or non-1-D array, a negative, repeated or shared index, or a client-count mismatch.
    """
    p = Path(path)
    arrays = _read(p)
    clients: dict[int, dict[str, IndexArray]] = {}
    unknown: list[str] = []
    for key, value in arrays.items():
        m = _CLIENT_KEY.fullmatch(key)
        if m:
            clients.setdefault(int(m.group(2)), {})[m.group(1)] = _indices(p, key, value)
        elif key not in (GLOBAL_KEY, SPEC_KEY):
            unknown.append(key)
    if unknown:
        _log.warning(
            "partition file %s: ignoring arrays %s (known: train_idx_K, test_idx_K, %s, %s)",
            p,
            sorted(unknown),
            GLOBAL_KEY,
            SPEC_KEY,
        )
    k = _client_count(p, clients)
    glob = (
        _indices(p, GLOBAL_KEY, arrays[GLOBAL_KEY])
        if GLOBAL_KEY in arrays
        else np.empty(0, np.int64)
    )
    pf = PartitionFile(
        p,
        tuple(clients[i]["train"] for i in range(k)),
        tuple(clients[i]["test"] for i in range(k)),
        glob,
        _spec(p, arrays.get(SPEC_KEY)),
    )
    _check_disjoint(pf)
    if num_clients is not None:
        pf.check_clients(num_clients)
    return pf


def split_from_file(dataset: Any, pf: PartitionFile) -> FederatedSplit:
    """The :class:`FederatedSplit` of ``dataset`` that ``pf`` describes (``spec`` None).

    Raises:
        ConfigError: an index outside the dataset.
    """
    pf.check_dataset(len(dataset), dataset.name)
    return FederatedSplit(dataset, None, global_test_of(pf), pf.train, pf.test)


def global_test_of(pf: PartitionFile) -> IndexArray:
    """The file's global test set, else the union of its clients' test sets: every agent is
    then also scored on the data all the others are tested on."""
    if len(pf.global_test):
        return pf.global_test
    return np.sort(np.concatenate([np.asarray(t, np.int64) for t in pf.test]))


def spec_of(pf: PartitionFile) -> PartitionSpec | None:
    """The :class:`PartitionSpec` recorded in a file our export wrote, if any."""
    spec = pf.spec.get("spec")
    return PartitionSpec.from_dict(spec) if isinstance(spec, dict) else None


# ----- reading and checking ---------------------------------------------------------------------
def _read(p: Path) -> dict[str, npt.NDArray[Any]]:
    if not p.is_file():
        raise ConfigError(f"partition file {p} does not exist")
    try:
        data = np.load(p, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise ConfigError(f"partition file {p}: cannot read it as .npz: {exc}") from exc
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise ConfigError(f"partition file {p}: expected an .npz archive, got one array")
    try:
        with data:
            return {key: data[key] for key in data.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise ConfigError(f"partition file {p}: cannot read it as .npz: {exc}") from exc


def _indices(p: Path, key: str, value: npt.NDArray[Any]) -> IndexArray:
    if value.ndim != 1 or not (np.issubdtype(value.dtype, np.integer) or value.size == 0):
        raise ConfigError(
            f"partition file {p}: {key} must be a 1-D integer array, got {value.dtype} "
            f"{list(value.shape)}"
        )
    idx = value.astype(np.int64)
    if idx.size and int(idx.min()) < 0:
        raise ConfigError(f"partition file {p}: {key} holds negative index {int(idx.min())}")
    uniq, counts = np.unique(idx, return_counts=True)
    if uniq.size != idx.size:
        raise ConfigError(
            f"partition file {p}: {key} repeats index {int(uniq[counts > 1][0])} "
            f"({int((counts > 1).sum())} indices appear more than once)"
        )
    return uniq  # sorted, as every split of the toolkit


def _client_count(p: Path, clients: dict[int, dict[str, IndexArray]]) -> int:
    if not clients:
        raise ConfigError(f"partition file {p} holds no train_idx_K / test_idx_K arrays")
    k = max(clients) + 1
    for i in range(k):
        have = clients.get(i, {})
        missing = [f"{part}_idx_{i}" for part in ("train", "test") if part not in have]
        if missing:
            raise ConfigError(
                f"partition file {p}: client {i} is missing {', '.join(missing)} "
                f"(the file names clients up to {k - 1}; every client 0..{k - 1} needs both)"
            )
        if have["train"].size == 0:
            raise ConfigError(f"partition file {p}: train_idx_{i} is empty")
    return k


def _check_disjoint(pf: PartitionFile) -> None:
    """No index in two arrays (within a client or across clients and the global test set)."""
    owner: dict[int, str] = {}
    for key, arr in pf._arrays():
        for i in arr.tolist():
            other = owner.setdefault(i, key)
            if other != key:
                raise ConfigError(
                    f"partition file {pf.path}: index {i} is in both {other} and {key}; "
                    "client and global test sets must not overlap"
                )


def _spec(p: Path, value: npt.NDArray[Any] | None) -> dict[str, Any]:
    if value is None:
        return {}
    try:
        meta = json.loads(str(value.item()))
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"partition file {p}: {SPEC_KEY} is not JSON: {exc}") from exc
    if not isinstance(meta, dict):
        raise ConfigError(f"partition file {p}: {SPEC_KEY} must be a JSON object")
    return meta
