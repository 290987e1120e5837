"""CCVR, edge half: FedAvg's, plus the ``upload_stats`` phase: load the final global model and
send per-class feature means, unbiased covariances and counts over the training data.

Under ``hyper.dp`` the rounds train by DP-SGD (FedAvg's), and the statistics leave as a
post-processing of one release of per-class sums (:func:`class_moment_sums`, then
:func:`stats_from_sums`): each feature clipped to L2 norm ``C``, the sums of the features
(sensitivity ``C``), of their outer products (Frobenius sensitivity ``C**2``) and the counts
noised by the one release, the means and covariances formed after the noise, each covariance
made positive semi-definite (docs/concepts/privacy.md)."""

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
from edge_agent.class_stats import ClassMeans
from edge_agent.dp import clip_rows
from edge_agent.trainer import TensorData
from models import Classifier
from protocol.algorithms.ccvr import CCVRConfig
from protocol.contract.arrays import Encoding
from protocol.contract.messages import Task
from protocol.contract.payloads import ClassStats, TensorMap

__all__ = ["CCVREdge", "class_moment_sums", "class_stats", "stats_from_sums"]


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


@torch.no_grad()
def class_moment_sums(
    model: Classifier, data: TensorData, num_classes: int, clip: float, batch_size: int = 64
) -> tuple[ClassMeans, ClassMeans]:
    """Per-class sums of the features of ``data`` (eval mode, one pass), each clipped to L2
    norm ``clip``, and of their outer products (flattened ``D * D``), each of Frobenius norm
    ``||x||**2 <= clip**2``: the bounds the release noises them at (``ClassMeans.clip``)."""
    was_training = model.training
    model.eval()
    dev, d = data.x.device, model.num_features
    first = ClassMeans(num_classes, d, dev, clip)
    second = ClassMeans(num_classes, d * d, dev, clip * clip)
    for x, y in data.batches(batch_size, None, shuffle=False):
        f = clip_rows(model.forward_features(x).float(), clip)
        first.add(f, y)
        second.add((f.unsqueeze(2) * f.unsqueeze(1)).flatten(1), y)
    model.train(was_training)
    return first, second


def stats_from_sums(
    first: ClassMeans, second: ClassMeans, encoding: Encoding = "raw"
) -> ClassStats:
    """Means and unbiased covariances of the classes with a count (post-processing of the
    noised sums): ``mu = S1 / n``, ``Sigma = (S2 - n mu mu^T) / (n - 1)`` (zero for ``n = 1``),
    symmetrised, and its negative eigenvalues (noise) set to zero, so that every covariance
    is positive semi-definite, as the payload promises."""
    present = first.present()
    n = first.counts[present].double().cpu()
    d = first.sums.shape[1]
    mu = first.sums[present].double().cpu() / n.unsqueeze(1)
    s2 = second.sums[present].double().cpu().reshape(-1, d, d)
    denom = (n - 1).clamp_min(1).view(-1, 1, 1)
    cov = (s2 - n.view(-1, 1, 1) * mu.unsqueeze(2) * mu.unsqueeze(1)) / denom
    cov[n <= 1] = 0.0
    vals, vecs = torch.linalg.eigh((cov + cov.transpose(1, 2)) / 2)
    cov = (vecs * vals.clamp_min(0).unsqueeze(1)) @ vecs.transpose(1, 2)
    c32 = cov.float().numpy()
    c32 = (c32 + c32.transpose(0, 2, 1)) / 2  # exactly symmetric in float32
    return ClassStats(
        present.cpu().numpy().astype(np.int32),
        mu.float().numpy(),
        c32,
        first.counts[present].cpu().numpy().astype(np.int32),
        encoding=encoding,
    )


@register_edge_algorithm("ccvr")
class CCVREdge(WeightExchangeEdge[CCVRConfig]):
    """FedAvg's edge half with CCVR's statistics phase; ``final`` loads the calibrated model."""

    TASK_PAYLOADS: ClassVar[TaskPayloads] = task_payloads(
        {"weights": TensorMap}, ("upload_stats",), WeightExchangeEdge.TASK_PAYLOADS
    )
    DP_SUMS: ClassVar[int] = 2  # the features' sums and their outer products'
    DP_RELEASE_PHASE: ClassVar[str] = "upload_stats"

    def weight_encoding(self) -> Encoding:
        """As the run configures (``weight_encoding``)."""
        return self.config.weight_encoding

    def phases(self) -> dict[str, Callable[[Task], PhaseResult]]:
        """FedAvg's phases and ``upload_stats``."""
        return {**super().phases(), "upload_stats": self.stats_phase}

    def stats_phase(self, task: Task) -> PhaseResult:
        """Load the global model, reply with its class statistics over the training data
        (under ``hyper.dp``: formed from the release's noised sums)."""
        self.receive(task.payloads)
        cfg, ctx = self.config, self.ctx
        clip = self.dp_clip()
        if clip == 0:
            stats = class_stats(ctx.model, ctx.train, ctx.num_classes, cfg.stats_encoding)
            return PhaseResult({"stats": stats}, num_samples=len(ctx.train))
        self._dp_metrics = {}
        first, second = class_moment_sums(ctx.model, ctx.train, ctx.num_classes, clip)
        self.release([first, second], 1)
        stats = stats_from_sums(first, second, cfg.stats_encoding)
        return PhaseResult({"stats": stats}, dict(self._dp_metrics), len(ctx.train))
