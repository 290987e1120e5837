"""CCVR, server half: FedAvg rounds, then classifier calibration with virtual representations.

Plan: the training rounds (FedAvg's aggregation), ``upload_stats`` (every agent, with the global
model: per-class feature statistics up), ``final`` (the calibrated model down). After
``upload_stats``, :func:`global_class_stats` combines the agents' statistics and ``server_train``
samples virtual features and fine-tunes the global model's head on them
(``coordinator/strategies/head_training.py``, through the one server fit loop).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from coordinator.strategies.base import (
    AgentInfo,
    PhaseHooks,
    ServerContext,
    Step,
    register_strategy,
)
from coordinator.strategies.weight_averaging import WeightAveragingStrategy
from protocol.algorithms.ccvr import CCVRConfig
from protocol.contract.messages import Reply
from protocol.contract.payloads import ClassStats, TensorMap
from protocol.errors import AggregationError, ValidationError

__all__ = ["CCVRStrategy", "global_class_stats"]

HEAD_KEYS = ("head.weight", "head.bias")  # the classifier's head in the model's state dict
F64 = npt.NDArray[np.float64]


def global_class_stats(
    stats: list[ClassStats], num_classes: int
) -> tuple[npt.NDArray[np.int64], F64, F64, npt.NDArray[np.int64]]:
    """Global ``(class ids, means [K, D], covariances [K, D, D], counts [K])`` of the classes
    some agent holds: ``mu_c = sum_k N_ck mu_ck / N_c`` and

    ``Sigma_c = sum_k (N_ck - 1)/(N_c - 1) Sigma_ck + sum_k N_ck/(N_c - 1) mu_ck mu_ck^T
    - N_c/(N_c - 1) mu_c mu_c^T`` (zero for a class with a single sample)."""
    held = [s for s in stats if s.class_ids.size]
    if not held:
        raise AggregationError("ccvr: no class statistics to calibrate on")
    dims = {int(s.means.shape[1]) for s in held}
    if len(dims) > 1:
        raise AggregationError(f"ccvr: feature dimensions differ across agents: {sorted(dims)}")
    d = dims.pop()
    n = np.zeros(num_classes, np.int64)
    first = np.zeros((num_classes, d))
    second = np.zeros((num_classes, d, d))  # sum_k (N_ck - 1) S_ck + N_ck mu_ck mu_ck^T
    for s in held:
        mu, cov = s.means.astype(np.float64), s.covariances.astype(np.float64)
        nk = s.counts.astype(np.float64)
        n[s.class_ids] += s.counts
        first[s.class_ids] += nk[:, None] * mu
        second[s.class_ids] += (nk - 1)[:, None, None] * cov + nk[:, None, None] * (
            mu[:, :, None] * mu[:, None, :]
        )
    ids = np.nonzero(n)[0]
    nc = n[ids].astype(np.float64)
    means = first[ids] / nc[:, None]
    outer = means[:, :, None] * means[:, None, :]
    denom = np.maximum(nc - 1, 1)[:, None, None]
    covs = (second[ids] - nc[:, None, None] * outer) / denom
    covs[nc == 1] = 0.0
    return ids.astype(np.int64), means, covs, n[ids]


@register_strategy("ccvr")
class CCVRStrategy(WeightAveragingStrategy):
    """FedAvg whose final model's head is calibrated on virtual features."""

    config: CCVRConfig
    needs_class_counts = True  # each class's statistics are bounded by its registered samples

    def __init__(self, config: CCVRConfig, *, num_classes: int, seed: int = 0) -> None:
        super().__init__(config, num_classes=num_classes, seed=seed)
        self._pending: tuple[npt.NDArray[np.int64], F64, F64] | None = None

    def final_steps(self, rounds: int) -> list[Step]:
        """Statistics of the final global model from every agent, then the calibrated model."""
        return [Step(rounds + 1, "upload_stats", "all"), Step(rounds + 1, "final", "all")]

    def head_dim(self) -> int | None:
        """The feature size the global head takes (None before the first aggregation)."""
        if self.weights is None or HEAD_KEYS[0] not in self.weights.tensors:
            return None
        return int(self.weights.tensors[HEAD_KEYS[0]].shape[1])

    def phase_hooks(self) -> dict[str, PhaseHooks]:
        """FedAvg's phases, and ``upload_stats``: the global model down, statistics up, the
        head calibrated on them."""
        stats = PhaseHooks(
            self.send_weights, self.check_stats, self.aggregate_stats, self.calibrate
        )
        return {**super().phase_hooks(), "upload_stats": stats}

    def check_stats(self, step: Step, agent: AgentInfo, reply: Reply) -> None:
        """The agent's classes, at most its samples per class, the head's feature size."""
        stats = self.payload(reply, "stats", ClassStats)
        registered = agent.register.counts_by_class()
        for c, n in zip(stats.class_ids.tolist(), stats.counts.tolist(), strict=True):
            if c >= self.num_classes or n > registered.get(c, 0):
                raise ValidationError(
                    "reply.payloads.stats.counts",
                    f"at most the registered samples of class {c} ({registered.get(c, 0)})",
                    n,
                )
        dim = self.head_dim()
        if dim is not None and stats.class_ids.size and stats.means.shape[1] != dim:
            raise ValidationError(
                "reply.payloads.stats.means", f"dimension {dim}", stats.means.shape[1]
            )

    def aggregate_stats(
        self, step: Step, replies: list[tuple[AgentInfo, Reply]]
    ) -> dict[str, float]:
        """Combine the agents' statistics for :meth:`server_train`."""
        stats = [self.payload(r, "stats", ClassStats) for _, r in replies]
        ids, means, covs, counts = global_class_stats(stats, self.num_classes)
        self._pending = (ids, means, covs)
        return {"calibration_classes": float(ids.size), "calibration_samples": float(counts.sum())}

    def calibrate(self, step: Step, ctx: ServerContext) -> dict[str, float]:
        """Sample virtual features and fine-tune the global head on them."""
        if self._pending is None:
            return {}
        ids, means, covs = self._pending
        self._pending = None
        if self.weights is None or not set(HEAD_KEYS) <= set(self.weights.tensors):
            raise AggregationError(f"ccvr: the global model has no {HEAD_KEYS} to calibrate")
        from coordinator.strategies.head_training import (
            calibrate_head,  # torch only on the server's path
        )
        from models.fit import FitError

        head = TensorMap({k.split(".")[1]: self.weights.tensors[k] for k in HEAD_KEYS})
        try:
            head, metrics = calibrate_head(head, ids, means, covs, cfg=self.config, ctx=ctx)
        except FitError as exc:  # the engine closes the step failed and keeps the last state
            raise AggregationError(f"ccvr: calibration failed: {exc}") from exc
        tensors = dict(self.weights.tensors)
        tensors.update({k: head.tensors[k.split(".")[1]] for k in HEAD_KEYS})
        self.weights = TensorMap(tensors, encoding=self.config.weight_encoding)
        return metrics
