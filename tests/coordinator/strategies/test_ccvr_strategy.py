"""CCVR server half: the global class statistics by hand and against pooled data, virtual
feature sampling, calibration of the global head only, validation (whole runs:
test_every_algorithm.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import fake_agent

import coordinator.strategies.ccvr
import edge_agent.algorithms.ccvr  # noqa: F401  (registers both halves)
from coordinator.strategies import AgentInfo, ServerContext, Step, create_strategy
from coordinator.strategies.ccvr import global_class_stats
from coordinator.strategies.head_training import sample_virtual_features
from protocol.algorithms.ccvr import CCVRConfig
from protocol.contract.messages import Reply
from protocol.contract.payloads import ClassStats, TensorMap
from protocol.errors import ValidationError

C, D = 3, 2


def agent(device_id: str, counts: dict[int, int]) -> AgentInfo:
    return fake_agent(device_id, "ccvr", counts, num_classes=C, arch="mlp_s")


def stats_of(features: dict[int, np.ndarray]) -> ClassStats:
    ids = sorted(features)
    d = next(iter(features.values())).shape[1]
    covs = [
        np.cov(features[c], rowvar=False, ddof=1).reshape(d, d)
        if len(features[c]) > 1
        else np.zeros((d, d))
        for c in ids
    ]
    c32 = np.array(covs, np.float32)
    return ClassStats(
        np.array(ids),
        np.array([features[c].mean(0) for c in ids], np.float32),
        (c32 + c32.transpose(0, 2, 1)) / 2,
        np.array([len(features[c]) for c in ids], np.int32),
    )


def reply(payloads: dict, phase: str = "upload_stats") -> Reply:
    return Reply(task_id="t", round=3, phase=phase, num_samples=10, payloads=payloads)


def test_global_covariance_combines_within_and_between_client_terms_by_hand() -> None:
    # class 0: a holds {0, 2} (mean 1, var 2), b holds {4} (mean 4, var 0); pooled {0, 2, 4}:
    # mean 2, var 4 = 1/2 * 2 + (2/2 * 1 + 1/2 * 16) - 3/2 * 4
    a = stats_of({0: np.array([[0.0], [2.0]])})
    b = stats_of({0: np.array([[4.0]]), 2: np.array([[7.0]])})
    ids, means, covs, counts = global_class_stats([a, b], C)
    assert ids.tolist() == [0, 2] and counts.tolist() == [3, 1]
    np.testing.assert_allclose(means[:, 0], [2.0, 7.0])
    np.testing.assert_allclose(covs[:, 0, 0], [4.0, 0.0])  # one sample: zero covariance


def test_global_statistics_equal_those_of_the_pooled_features() -> None:
    rng = np.random.default_rng(0)
    parts = [
        {0: rng.normal(size=(7, 3)), 1: rng.normal(2, size=(4, 3))},
        {0: rng.normal(size=(5, 3))},
    ]
    ids, means, covs, _ = global_class_stats([stats_of(p) for p in parts], C)
    pooled = {0: np.concatenate([parts[0][0], parts[1][0]]), 1: parts[0][1]}
    for i, c in enumerate(ids.tolist()):
        np.testing.assert_allclose(means[i], pooled[c].mean(0), rtol=1e-5)
        np.testing.assert_allclose(covs[i], np.cov(pooled[c], rowvar=False), rtol=1e-4, atol=1e-5)


def test_virtual_features_follow_the_class_gaussians() -> None:
    means = np.array([[1.0, -1.0], [5.0, 5.0]])
    covs = np.array([[[2.0, 0.5], [0.5, 1.0]], np.zeros((2, 2))])
    x = sample_virtual_features(means, covs, 20000, torch.Generator().manual_seed(0))
    assert x.shape == (2, 20000, 2)
    np.testing.assert_allclose(x[0].mean(0), means[0], atol=0.05)
    np.testing.assert_allclose(np.cov(x[0], rowvar=False), covs[0], atol=0.08)
    np.testing.assert_allclose(x[1], np.broadcast_to(means[1], (20000, 2)), atol=1e-6)


def model_weights() -> TensorMap:
    return TensorMap(
        {
            "trunk.w": np.full((4, 4), 3.0),
            "head.weight": np.zeros((C, D)),
            "head.bias": np.zeros(C),
        }
    )


def strategy(**hyper: object) -> coordinator.strategies.ccvr.CCVRStrategy:
    s = create_strategy("ccvr", CCVRConfig().replace(**hyper), num_classes=C, seed=0)
    assert isinstance(s, coordinator.strategies.ccvr.CCVRStrategy)
    return s


def test_calibration_trains_only_the_head_and_goes_down_in_final() -> None:
    s = strategy(calib_epochs=5, calib_lr=0.5)
    assert [st.phase for st in s.plan(2)] == ["train", "train", "upload_stats", "final"]
    s.load_state_dict({"weights": model_weights()})
    a, b = agent("a", {0: 10, 1: 10}), agent("b", {2: 10})
    rng = np.random.default_rng(1)
    centers = {0: [4.0, 0.0], 1: [0.0, 4.0], 2: [-4.0, -4.0]}
    feats_a = {c: rng.normal(centers[c], 0.5, size=(10, D)) for c in (0, 1)}
    replies = [
        (a, reply({"stats": stats_of(feats_a)})),
        (b, reply({"stats": stats_of({2: rng.normal(centers[2], 0.5, size=(10, D))})})),
    ]
    step = Step(3, "upload_stats", "all")
    for ag, r in replies:
        s.validate(step, ag, r)
    agg = s.aggregate(step, replies)
    assert agg == {"calibration_classes": 3.0, "calibration_samples": 30.0}
    metrics = s.server_train(step, ServerContext.for_step(0, 2, "cpu"))
    assert metrics["virtual_features"] == 600 and metrics["head_acc"] > 0.95
    sent = s.configure(Step(3, "final", "all"), a)["weights"]
    assert isinstance(sent, TensorMap)
    np.testing.assert_array_equal(sent.tensors["trunk.w"], np.full((4, 4), 3.0))
    w = sent.tensors["head.weight"]
    assert w.shape == (C, D) and np.abs(w).sum() > 0  # the zero head was calibrated


def test_statistics_that_do_not_fit_are_refused() -> None:
    s = strategy()
    s.load_state_dict({"weights": model_weights()})
    a = agent("a", {0: 2})
    step = Step(3, "upload_stats", "all")
    too_many = stats_of({0: np.zeros((3, D))})
    with pytest.raises(ValidationError, match="registered samples of class 0"):
        s.validate(step, a, reply({"stats": too_many}))
    with pytest.raises(ValidationError, match="dimension 2"):
        s.validate(step, a, reply({"stats": stats_of({0: np.ones((2, D + 1))})}))
