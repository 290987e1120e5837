"""CCVR, edge half: FedAvg's, plus the ``upload_stats`` phase: load the final global model and
send per-class feature means, unbiased covariances and counts over the training data."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np
import torch

from edge_agent.algorithms.base import (
    PhaseResult,
    TaskPayloads,
    register_edge_algorithm,
    task_payloads,
)
from edge_agent.algorithms.weights import WeightExchangeEdge
from edge_agent.trainer import TensorData
from models import Classifier
from protocol.algorithms.ccvr import CCVRConfig
from protocol.contract.arrays import Encoding
from protocol.contract.messages import Task
from protocol.contract.payloads import ClassStats, TensorMap

__all__ = ["CCVREdge", "class_stats"]


@torch.no_grad()
def class_stats(
    model: Classifier, data: TensorData, num_classes: int, encoding: Encoding = "raw"
) -> ClassStats:
    """Mean, covariance (``N - 1`` in the denominator; zero for one sample) and count of the
    features of every class in ``data`` (eval mode)."""
    was_training = model.training
    model.eval()
    feats = torch.cat(
        [model.forward_features(x).double() for x, _ in data.batches(256, None, shuffle=False)]
    ).cpu()
    model.train(was_training)
    y = data.y.cpu()
    ids = [c for c in range(num_classes) if bool((y == c).any())]
    d = feats.shape[1] if feats.ndim == 2 else model.num_features
    means, covs, counts = np.zeros((len(ids), d)), np.zeros((len(ids), d, d)), []
    for i, c in enumerate(ids):
        f = feats[y == c].numpy()
        means[i] = f.mean(0)
        if len(f) > 1:
            covs[i] = np.cov(f, rowvar=False, ddof=1).reshape(d, d)
        counts.append(len(f))
    c32 = covs.astype(np.float32)
    c32 = (c32 + c32.transpose(0, 2, 1)) / 2  # exactly symmetric in float32
    return ClassStats(
        np.array(ids, np.int32),
        means.astype(np.float32),
        c32,
        np.array(counts, np.int32),
        encoding=encoding,
    )


@register_edge_algorithm("ccvr")
class CCVREdge(WeightExchangeEdge[CCVRConfig]):
    """FedAvg's edge half with CCVR's statistics phase; ``final`` loads the calibrated model."""

    TASK_PAYLOADS: ClassVar[TaskPayloads] = task_payloads(
        {"weights": TensorMap}, ("upload_stats",), WeightExchangeEdge.TASK_PAYLOADS
    )

    def weight_encoding(self) -> Encoding:
        """As the run configures (``weight_encoding``)."""
        return self.config.weight_encoding

    def phases(self) -> dict[str, Callable[[Task], PhaseResult]]:
        """FedAvg's phases and ``upload_stats``."""
        return {**super().phases(), "upload_stats": self.stats_phase}

    def stats_phase(self, task: Task) -> PhaseResult:
        """Load the global model, reply with its class statistics over the training data."""
        self.receive(task.payloads)
        cfg = self.config
        stats = class_stats(
            self.ctx.model, self.ctx.train, self.ctx.num_classes, cfg.stats_encoding
        )
        return PhaseResult({"stats": stats}, num_samples=len(self.ctx.train))
