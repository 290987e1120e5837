"""CCVR edge half: the statistics phase loads the global model, then sends per-class means,
unbiased covariances and counts of its features (checked against numpy)."""

from __future__ import annotations

import numpy as np
import torch
from helpers import edge_algorithm, edge_context

import coordinator.strategies.ccvr  # noqa: F401  (registers both halves)
from edge_agent.algorithms.ccvr import CCVREdge
from edge_agent.algorithms.weights import module_to_tensormap
from models import Classifier, create_model
from protocol.algorithms.ccvr import CCVRConfig
from protocol.contract.messages import Task
from protocol.contract.payloads import ClassStats

C, D = 3, 4


def build() -> Classifier:
    return create_model("mlp_s", num_classes=C, in_chans=1, feature_dim=D, input_size=8)


def make_edge() -> CCVREdge:
    torch.manual_seed(0)
    y = torch.tensor([0, 0, 0, 2, 2, 1])  # class 1: a single sample
    x = torch.rand(len(y), 1, 8, 8)
    return edge_algorithm("ccvr", CCVREdge, edge_context(build(), x, y, num_classes=C))


def test_stats_phase_sends_the_class_statistics_of_the_global_model() -> None:
    edge = make_edge()
    torch.manual_seed(7)
    global_model = build()  # weights unlike the agent's own
    task = Task(
        task_id="t",
        run_id="r",
        round=3,
        phase="upload_stats",
        deadline=0.0,
        algorithm="ccvr",
        config=CCVRConfig().to_dict(),
        payloads={"weights": module_to_tensormap(global_model)},
    )
    result = edge.handle(task)
    stats = result.payloads["stats"]
    assert isinstance(stats, ClassStats)
    global_model.eval()
    with torch.no_grad():
        feats = global_model.forward_features(edge.ctx.train.x).double().numpy()
    y = edge.ctx.train.y.numpy()
    assert stats.class_ids.tolist() == [0, 1, 2] and stats.counts.tolist() == [3, 1, 2]
    for i, c in enumerate([0, 1, 2]):
        f = feats[y == c]
        np.testing.assert_allclose(stats.means[i], f.mean(0), rtol=1e-5, atol=1e-6)
        want = np.cov(f, rowvar=False) if len(f) > 1 else np.zeros((D, D))
        np.testing.assert_allclose(stats.covariances[i], want, rtol=1e-4, atol=1e-6)
