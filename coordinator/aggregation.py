"""Aggregation rules shared by strategies: one weighted mean for tensor maps.

FedAvg's global model, Felo's per-architecture group models, FedVTC's generator and (later)
FedType's proxies, FML/FedKD's shared models and LG-FedAvg's heads are all a weighted mean of
state dicts. One function, one rule for integer buffers: they are counters such as BatchNorm's
``num_batches_tracked``, whose mean is meaningless, so the aggregate takes the maximum.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from protocol.arrays import Encoding
from protocol.errors import AggregationError
from protocol.payloads import TensorMap

__all__ = ["weighted_mean"]


def weighted_mean(
    maps: Sequence[TensorMap],
    weights: Sequence[float] | None = None,
    encoding: Encoding = "raw",
    what: str = "weights",
) -> TensorMap:
    """Float tensors: ``sum_i w_i * t_i / sum_i w_i`` (plain mean without ``weights``), in
    float64; integer tensors: element-wise maximum. All maps must carry the same names and
    shapes; ``what`` names the payload in errors."""
    if not maps:
        raise AggregationError(f"no {what} to average")
    w = np.ones(len(maps)) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (len(maps),) or not np.all(np.isfinite(w)) or w.min() < 0 or w.sum() <= 0:
        raise AggregationError(f"{what}: need {len(maps)} non-negative weights, got {weights}")
    w = w / w.sum()
    names = set(maps[0].tensors)
    if any(set(m.tensors) != names for m in maps):
        raise AggregationError(f"{what}: uploads carry different tensor names")
    out: dict[str, np.ndarray] = {}
    for name in sorted(names):
        arrs = [m.tensors[name] for m in maps]
        if any(a.shape != arrs[0].shape for a in arrs):
            raise AggregationError(f"{what}: tensor {name} has different shapes across uploads")
        if arrs[0].dtype.kind == "f" and weights is None:
            out[name] = np.mean(np.stack(arrs).astype(np.float64), axis=0).astype(np.float32)
        elif arrs[0].dtype.kind == "f":
            acc = np.zeros(arrs[0].shape, np.float64)
            for wi, a in zip(w, arrs, strict=True):
                acc += wi * a.astype(np.float64)
            out[name] = acc.astype(np.float32)
        else:
            out[name] = np.max(np.stack(arrs), axis=0)
    return TensorMap(out, encoding=encoding)
