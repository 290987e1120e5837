"""Aggregation rules shared by strategies: one weighted mean, and its robust variants.

FedAvg's global model, Felo's per-architecture group models, FedVTC's generator, FedType's
proxies, FML/FedKD's shared models and LG-FedAvg's heads are all a weighted mean of state dicts.
One function, one rule for integer buffers: they are counters such as BatchNorm's
``num_batches_tracked``, whose mean is meaningless, so the aggregate takes the maximum.

Robust variants (``docs/concepts/security.md`` "Robust aggregation") replace that mean when a
run's config asks for one (:class:`RobustRule`, from ``AveragingConfig``): the coordinate-wise
median, the coordinate-wise trimmed mean, and an optional norm bound applied before either. They
take the same tensor maps (:func:`aggregate_maps`) or one vector per upload (:func:`reduce_rows`,
:func:`reduce_by_class` for per-class prototypes, logits and features). Servers that train on
the individual uploads instead of averaging them can leave outliers out (:func:`screen_by_class`).
The plain mean stays :func:`weighted_mean` itself, so a run without the option never goes
through the robust code paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from protocol.contract.arrays import Encoding
from protocol.contract.payloads import TensorMap
from protocol.errors import AggregationError

__all__ = [
    "MEAN",
    "Reduction",
    "RobustRule",
    "aggregate_maps",
    "reduce_by_class",
    "reduce_rows",
    "screen_by_class",
    "weighted_mean",
]

Reduction = Literal["mean", "median", "trimmed_mean"]
F64 = npt.NDArray[np.float64]


@dataclass(frozen=True)
class RobustRule:
    """How one coordinate of many uploads becomes one value.

    ``method``:

    * ``mean``: the weighted mean (sample counts where the strategy has them).
    * ``median``: the coordinate-wise median, **unweighted**: sample counts are self-reported,
      and a weighted median would let one reply that claims more than half of the samples
      dictate every coordinate. With an honest majority every coordinate of the result lies
      within the honest uploads' range, whatever the others send.
    * ``trimmed_mean``: per coordinate, the ``k = ceil(trim_fraction * n)`` lowest and ``k``
      highest values are dropped (at most ``(n - 1) // 2`` each, so one value always remains)
      and the rest averaged with their sample weights. ``k`` >= the number of attackers bounds
      the result to the honest range. Ceiling, not floor: a class held by 7 uploads still
      loses one value at each end under ``trim_fraction = 0.1`` (with floor, none).

    ``clip_norm`` (0 = off): before reducing, each upload's deviation from the coordinate-wise
    median of the uploads is scaled down to at most ``clip_norm`` times the median of those
    deviations' norms (centred clipping). Relative, not absolute: one number then serves model
    weights (norms of tens) and prototypes or logits (of order 1 to 100) on any model, without
    tuning to each payload's scale, and both the centre and the scale are medians, which a
    minority cannot move far. An attacker's pull on a mean is thus at most its weight times
    ``clip_norm`` times a typical honest deviation.
    """

    method: Reduction = "mean"
    trim_fraction: float = 0.1
    clip_norm: float = 0.0

    @property
    def plain(self) -> bool:
        """The plain (weighted) mean without clipping: :func:`weighted_mean` exactly."""
        return self.method == "mean" and self.clip_norm == 0


MEAN = RobustRule()


def _checked_weights(
    maps: Sequence[TensorMap], weights: Sequence[float] | None, what: str
) -> tuple[F64, list[str]]:
    """Normalised weights and the sorted tensor names; raises for inconsistent uploads."""
    if not maps:
        raise AggregationError(f"no {what} to average")
    w = np.ones(len(maps)) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (len(maps),) or not np.all(np.isfinite(w)) or w.min() < 0 or w.sum() <= 0:
        raise AggregationError(f"{what}: need {len(maps)} non-negative weights, got {weights}")
    names = set(maps[0].tensors)
    if any(set(m.tensors) != names for m in maps):
        raise AggregationError(f"{what}: uploads carry different tensor names")
    return w / w.sum(), sorted(names)


def _stacked(maps: Sequence[TensorMap], name: str, what: str) -> np.ndarray:
    arrs = [m.tensors[name] for m in maps]
    if any(a.shape != arrs[0].shape for a in arrs):
        raise AggregationError(f"{what}: tensor {name} has different shapes across uploads")
    return np.stack(arrs)


def weighted_mean(
    maps: Sequence[TensorMap],
    weights: Sequence[float] | None = None,
    encoding: Encoding = "raw",
    what: str = "weights",
) -> TensorMap:
    """Float tensors: ``sum_i w_i * t_i / sum_i w_i`` (plain mean without ``weights``), in
    float64; integer tensors: element-wise maximum. All maps must carry the same names and
    shapes; ``what`` names the payload in errors."""
    w, names = _checked_weights(maps, weights, what)
    out: dict[str, np.ndarray] = {}
    for name in names:
        stack = _stacked(maps, name, what)
        if stack.dtype.kind == "f" and weights is None:
            out[name] = np.mean(stack.astype(np.float64), axis=0).astype(np.float32)
        elif stack.dtype.kind == "f":
            acc = np.zeros(stack.shape[1:], np.float64)
            for wi, a in zip(w, stack, strict=True):
                acc += wi * a.astype(np.float64)
            out[name] = acc.astype(np.float32)
        else:
            out[name] = np.max(stack, axis=0)
    return TensorMap(out, encoding=encoding)


def _reduce(x: F64, w: F64, rule: RobustRule) -> F64:
    """Reduce ``x`` ``[n, ...]`` over its first axis; ``w`` ``[n]`` are normalised weights."""
    n = x.shape[0]
    if rule.method == "median":
        return np.median(x, axis=0)  # type: ignore[no-any-return]
    k = 0
    if rule.method == "trimmed_mean":
        # the epsilon keeps 0.3 * 10 = 3.0000000000000004 from trimming 4 instead of 3
        k = min(int(np.ceil(rule.trim_fraction * n - 1e-9)), (n - 1) // 2)
    if k == 0:
        return np.tensordot(w, x, axes=(0, 0))  # type: ignore[no-any-return]
    order = np.argsort(x, axis=0, kind="stable")[k : n - k]
    kept, kept_w = np.take_along_axis(x, order, axis=0), w[order]
    return (kept_w * kept).sum(axis=0) / kept_w.sum(axis=0)  # type: ignore[no-any-return]


def _clip_factors(sq_norms: F64, clip_norm: float) -> F64:
    """Per upload: ``min(1, clip_norm * median(norm) / norm)`` of its deviation's norm."""
    norms = np.sqrt(sq_norms)
    bound = clip_norm * float(np.median(norms))
    safe = np.where(norms > 0, norms, 1.0)
    return np.where(norms > bound, bound / safe, 1.0)


def reduce_rows(
    values: npt.ArrayLike, rule: RobustRule, weights: npt.ArrayLike | None = None
) -> F64:
    """One vector from ``values`` ``[n, d]`` (one row per upload) under ``rule``, in float64.

    ``weights`` (``[n]``, default equal) are used by ``mean`` and ``trimmed_mean``; ``median``
    ignores them (see :class:`RobustRule`). Norms for ``clip_norm`` are over the whole row.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 2 or not x.shape[0]:
        raise AggregationError(f"need one row per upload, got shape {x.shape}")
    w = np.ones(x.shape[0]) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (x.shape[0],) or not np.all(np.isfinite(w)) or w.min() < 0 or w.sum() <= 0:
        raise AggregationError(f"need {x.shape[0]} non-negative weights, got {w.tolist()}")
    w = w / w.sum()
    if rule.clip_norm > 0:
        center = np.median(x, axis=0)
        dev = x - center
        x = center + dev * _clip_factors((dev**2).sum(axis=1), rule.clip_norm)[:, None]
    return _reduce(x, w, rule)


def reduce_by_class(
    class_ids: npt.ArrayLike,
    values: npt.ArrayLike,
    rule: RobustRule,
    weights: npt.ArrayLike | None = None,
) -> tuple[npt.NDArray[np.int64], F64]:
    """Per class, :func:`reduce_rows` over the rows of that class (the uploads holding it).

    ``class_ids`` ``[m]`` labels the rows of ``values`` ``[m, d]``; returns the sorted class ids
    present and their reduced vectors ``[len(ids), d]``. Clipping is per class: centre and scale
    are that class's median and median deviation norm.
    """
    ids = np.asarray(class_ids, dtype=np.int64)
    x = np.asarray(values, dtype=np.float64)
    w = np.ones(ids.size) if weights is None else np.asarray(weights, dtype=np.float64)
    classes = np.unique(ids)
    out = np.zeros((classes.size, x.shape[1] if x.ndim == 2 else 0), np.float64)
    for j, c in enumerate(classes.tolist()):
        rows = ids == c
        out[j] = reduce_rows(x[rows], rule, w[rows])
    return classes, out


SCREEN_MIN_ROWS = 3  # fewer uploads of a class have no majority to judge an outlier by


def screen_by_class(
    class_ids: npt.ArrayLike, values: npt.ArrayLike, factor: float
) -> npt.NDArray[np.bool_]:
    """Which rows to keep when a server trains on individual uploads.

    Per class held by at least :data:`SCREEN_MIN_ROWS` rows: the distance of each row to the
    class's coordinate-wise median, and a row farther than ``factor`` times the median of those
    distances is dropped. Centre and scale are medians, so with an honest majority in a class a
    minority can move neither far; an upload that stays within ``factor`` typical deviations
    is kept, and bounded by them. Classes with fewer rows, and ``factor = 0``, keep every row.
    """
    ids = np.asarray(class_ids, dtype=np.int64)
    keep = np.ones(ids.size, dtype=bool)
    if factor <= 0 or not ids.size:
        return keep
    x = np.asarray(values, dtype=np.float64)
    for c in np.unique(ids).tolist():
        rows = np.flatnonzero(ids == c)
        if rows.size < SCREEN_MIN_ROWS:
            continue
        dist = np.linalg.norm(x[rows] - np.median(x[rows], axis=0), axis=1)
        keep[rows] = dist <= factor * float(np.median(dist))
    return keep


def aggregate_maps(
    maps: Sequence[TensorMap],
    weights: Sequence[float] | None = None,
    rule: RobustRule = MEAN,
    encoding: Encoding = "raw",
    what: str = "weights",
) -> TensorMap:
    """:func:`weighted_mean` under ``rule``; the plain mean *is* :func:`weighted_mean`.

    Robust rules treat every float coordinate of every tensor alike; ``clip_norm`` measures an
    upload's deviation over all its float tensors together (one model, one norm). Integer
    buffers take the lower median instead of the maximum, so one upload cannot inflate a
    counter.
    """
    if rule.plain:
        return weighted_mean(maps, weights, encoding, what)
    w, names = _checked_weights(maps, weights, what)
    n = len(maps)
    floats = [name for name in names if maps[0].tensors[name].dtype.kind == "f"]
    factors: F64 | None = None
    centers: dict[str, F64] = {}
    if rule.clip_norm > 0:  # first pass: the centre and each upload's deviation norm
        sq = np.zeros(n, np.float64)
        for name in floats:
            x = _stacked(maps, name, what).astype(np.float64)
            centers[name] = np.median(x, axis=0)
            sq += ((x - centers[name]) ** 2).reshape(n, -1).sum(axis=1)
        factors = _clip_factors(sq, rule.clip_norm)
    out: dict[str, np.ndarray] = {}
    for name in names:
        stack = _stacked(maps, name, what)
        if name not in floats:
            out[name] = np.sort(stack, axis=0)[(n - 1) // 2]
            continue
        x = stack.astype(np.float64)
        if factors is not None:
            scale = factors.reshape((n,) + (1,) * (x.ndim - 1))
            x = centers[name] + (x - centers[name]) * scale
        out[name] = _reduce(x, w, rule).astype(np.float32)
    return TensorMap(out, encoding=encoding)
