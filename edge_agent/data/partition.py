"""Seeded label partitions across clients: IID, Dirichlet (CCVR) and pathological.

Every scheme returns one sorted int64 index array per client, and every index of ``labels``
appears in exactly one of them. All randomness comes from one ``numpy.random.Generator``, so
the same arguments give the same partition in every process (with the same numpy version).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import numpy.typing as npt

from protocol.errors import ConfigError

__all__ = [
    "MAX_DIRICHLET_DRAWS",
    "SCHEMES",
    "SCHEME_NAMES",
    "IndexArray",
    "Scheme",
    "partition",
    "partition_with",
]

Scheme = Literal["iid", "dirichlet", "pathological"]
IndexArray = npt.NDArray[np.int64]
MAX_DIRICHLET_DRAWS = 1000  # resampling bound before a Dirichlet partition gives up


@dataclass(frozen=True)
class _Params:
    alpha: float
    classes_per_client: int
    min_size: int


def partition(
    labels: npt.ArrayLike,
    num_clients: int,
    *,
    scheme: Scheme,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    seed: int = 0,
    min_size: int = 10,
) -> list[IndexArray]:
    """Split sample indices across ``num_clients`` clients.

    Args:
        labels: Integer class label of every sample, ``[N]``.
        num_clients: Number of clients ``K >= 1``.
        scheme: ``"iid"`` (uniform random), ``"dirichlet"`` (per class, proportions over the
            clients ~ Dir(alpha * 1_K), as in CCVR) or ``"pathological"`` (each client holds
            exactly ``classes_per_client`` classes).
        alpha: Dirichlet concentration; smaller means stronger label skew.
        classes_per_client: Classes per client for ``"pathological"``.
        seed: Seed of the numpy Generator that drives every random choice.
        min_size: Smallest number of samples any client may get. Dirichlet partitions are
            redrawn until it holds (at most :data:`MAX_DIRICHLET_DRAWS` times).

    Returns:
        One sorted int64 array of sample indices per client; together they use every index
        exactly once.

    Raises:
        ConfigError: Bad arguments, or no partition satisfies ``min_size``.
    """
    return partition_with(
        labels,
        num_clients,
        np.random.default_rng(seed),
        scheme=scheme,
        alpha=alpha,
        classes_per_client=classes_per_client,
        min_size=min_size,
    )


def partition_with(
    labels: npt.ArrayLike,
    num_clients: int,
    rng: np.random.Generator,
    *,
    scheme: Scheme,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    min_size: int = 10,
) -> list[IndexArray]:
    """:func:`partition` drawing from a caller-owned Generator instead of a seed."""
    y = _check_labels(labels)
    _check_int("num_clients", num_clients, 1)
    _check_int("classes_per_client", classes_per_client, 1)
    _check_int("min_size", min_size, 0)
    if not (isinstance(alpha, (int, float)) and np.isfinite(alpha) and alpha > 0):
        raise ConfigError(f"partition alpha must be a finite number > 0, got {alpha!r}")
    if scheme not in SCHEMES:
        raise ConfigError(f"unknown partition scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    if num_clients * min_size > len(y):
        raise ConfigError(
            f"{len(y)} samples cannot give {num_clients} clients at least "
            f"{min_size} each; lower min_size or the number of clients"
        )
    parts = SCHEMES[scheme](
        y, num_clients, rng, _Params(float(alpha), classes_per_client, min_size)
    )
    sizes = [len(p) for p in parts]
    if min(sizes) < min_size:
        worst = int(np.argmin(sizes))
        raise ConfigError(
            f"{scheme} partition gives client {worst} only {sizes[worst]} samples "
            f"(min_size={min_size}); lower min_size or the number of clients"
        )
    return [np.sort(p).astype(np.int64) for p in parts]


def _check_labels(labels: npt.ArrayLike) -> IndexArray:
    y = np.asarray(labels)
    if y.ndim != 1 or y.size == 0 or not np.issubdtype(y.dtype, np.integer):
        raise ConfigError(f"labels must be a non-empty 1-D integer array, got {y.dtype} {y.shape}")
    if int(y.min()) < 0:
        raise ConfigError(f"labels must be >= 0, got {int(y.min())}")
    return y.astype(np.int64)


def _check_int(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"partition {name} must be an int >= {low}, got {value!r}")


# ----- schemes -----------------------------------------------------------------------------------
def _iid(y: IndexArray, k: int, rng: np.random.Generator, _: _Params) -> list[IndexArray]:
    return list(np.array_split(rng.permutation(len(y)), k))


def _dirichlet(y: IndexArray, k: int, rng: np.random.Generator, p: _Params) -> list[IndexArray]:
    by_class = [np.flatnonzero(y == cls) for cls in np.unique(y)]
    best = 0
    for _ in range(MAX_DIRICHLET_DRAWS):
        parts = _dirichlet_draw(by_class, len(y), k, rng, p.alpha)
        smallest = min(len(part) for part in parts)
        if smallest >= p.min_size:
            return parts
        best = max(best, smallest)
    raise ConfigError(
        f"no Dirichlet(alpha={p.alpha}) partition of {len(y)} samples over {k} clients gave "
        f"every client >= {p.min_size} samples in {MAX_DIRICHLET_DRAWS} draws (the best draw's "
        f"smallest client had {best}); raise alpha, lower min_size or use fewer clients"
    )


def _dirichlet_draw(
    by_class: list[IndexArray], n: int, k: int, rng: np.random.Generator, alpha: float
) -> list[IndexArray]:
    pieces: list[list[IndexArray]] = [[] for _ in range(k)]
    sizes = np.zeros(k, dtype=np.int64)
    for members in by_class:
        idx = rng.permutation(members)
        # CCVR / NIID-Bench: a client that already holds its fair share N/K gets no more
        open_ = sizes < n / k
        share = rng.dirichlet(np.full(k, alpha)) * open_
        if not share.sum() > 0:  # every weight underflowed (tiny alpha): spread evenly
            share = open_.astype(np.float64)
        cuts = (np.cumsum(share / share.sum()) * len(idx)).astype(np.int64)[:-1]
        for j, piece in enumerate(np.split(idx, cuts)):
            pieces[j].append(piece)
            sizes[j] += len(piece)
    return [np.concatenate(p) for p in pieces]


def _pathological(y: IndexArray, k: int, rng: np.random.Generator, p: _Params) -> list[IndexArray]:
    classes = np.unique(y)
    c, m = len(classes), p.classes_per_client
    if m > c:
        raise ConfigError(
            f"pathological partition: {m} classes per client, but the labels hold only {c} classes"
        )
    if k * m < c:
        raise ConfigError(
            f"pathological partition: {k} clients x {m} classes cannot cover all "
            f"{c} classes (every sample must be used); raise classes_per_client"
        )
    # class slots dealt round-robin over a shuffled class order: m distinct classes per client,
    # and every class held by floor or ceil of k*m/c clients
    order = rng.permutation(classes)
    owned = [order[(i * m + np.arange(m)) % c] for i in range(k)]
    pieces: list[list[IndexArray]] = [[] for _ in range(k)]
    for cls in classes:
        holders = [i for i in range(k) if cls in owned[i]]
        idx = rng.permutation(np.flatnonzero(y == cls))
        if len(idx) < len(holders):
            raise ConfigError(
                f"pathological partition: class {int(cls)} has {len(idx)} samples "
                f"but {len(holders)} clients must share it; use fewer clients"
            )
        for holder, piece in zip(holders, np.array_split(idx, len(holders)), strict=True):
            pieces[holder].append(piece)
    return [np.concatenate(piece) for piece in pieces]


SCHEMES: dict[str, Callable[[IndexArray, int, np.random.Generator, _Params], list[IndexArray]]] = {
    "iid": _iid,
    "dirichlet": _dirichlet,
    "pathological": _pathological,
}
SCHEME_NAMES: tuple[str, ...] = get_args(Scheme)
