"""CCVR under ``hyper.dp``: each sample's feature clipped to ``C`` bounds its outer product's
contribution to the covariance sum by ``C**2`` (Frobenius); the release noises the sums of
features, of outer products and the counts at ``z * C``, ``z * C**2`` and ``z``; the means and
covariances are formed after the noise (PSD); the rounds train by DP-SGD on one budget with
the statistics; with DP off the reply is what it was."""

from __future__ import annotations

import queue
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import edge_algorithm, edge_context

import coordinator.strategies.ccvr  # noqa: F401  (registers both halves)
from edge_agent import dp
from edge_agent.algorithms.ccvr import CCVREdge, class_moment_sums, class_stats
from edge_agent.dp_sgd import dp_sgd_noise_multiplier
from models import Classifier, create_model
from protocol.algorithms.ccvr import CCVRConfig
from protocol.contract.codec import Envelope
from protocol.contract.messages import ErrorReply, Reply, Task
from protocol.contract.payloads import ClassStats, pack_payloads
from protocol.transport.base import MemoryBroker
from tests.helpers_runtime import device_uplink, memory_agent, train_task

K, D = 3, 6


def _build() -> Classifier:
    return create_model("mlp_s", num_classes=K, in_chans=1, feature_dim=D, input_size=8)


def _edge() -> CCVREdge:
    torch.manual_seed(0)
    y = torch.tensor([0, 0, 0, 0, 2, 2, 2, 1, 1, 0])
    x = torch.rand(len(y), 1, 8, 8) * 4
    return edge_algorithm("ccvr", CCVREdge, edge_context(_build(), x, y, num_classes=K))


def _stats_task(config: dict[str, object], n: int = 1) -> Task:
    return Task(
        task_id=f"t.s{n}",
        run_id="t",
        round=n,
        phase="upload_stats",
        deadline=1e12,
        algorithm="ccvr",
        config=config,  # type: ignore[arg-type]
    )


def test_one_samples_contribution_to_the_covariance_sum_is_bounded_by_the_clip_squared() -> None:
    # Prepare: a clip every feature exceeds, and the same data less its last sample
    edge = _edge()
    model, data = edge.ctx.model, edge.ctx.train
    clip = 0.05
    model.eval()
    with torch.no_grad():
        norms = model.forward_features(data.x).norm(dim=1)
    assert float(norms.min()) > clip  # the clip binds on every sample
    # Execute
    first, second = class_moment_sums(model, data, K, clip)
    less = type(data)(data.x[:-1], data.y[:-1])
    first_less, second_less = class_moment_sums(model, less, K, clip)
    # Assert: the sample moves its class's sums by exactly C (features) and C**2 (outer
    # products, Frobenius), no other class's, and the sums say which bound they were clipped to
    c = int(data.y[-1])
    moved = (second.sums - second_less.sums).norm(dim=1)
    assert float(moved[c]) == pytest.approx(clip**2, rel=1e-4)
    assert float(moved[c]) <= clip**2 * (1 + 1e-5)
    assert float((first.sums - first_less.sums).norm(dim=1)[c]) == pytest.approx(clip, rel=1e-4)
    assert float(moved.sum() - moved[c]) == 0.0
    assert (first.clip, second.clip) == (clip, clip**2)


def test_the_release_noises_each_sum_at_its_sensitivity_and_the_covariances_are_psd(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prepare: record every noise the release draws
    drawn: list[tuple[tuple[int, ...], float]] = []
    real = dp._gauss

    def spy(shape, sd, rng, device):  # type: ignore[no-untyped-def]
        drawn.append((tuple(shape), sd))
        return real(shape, sd, rng, device)

    monkeypatch.setattr(dp, "_gauss", spy)
    edge = _edge()
    clip = 0.5
    cfg = CCVRConfig(dp_epsilon=2.0, dp_releases=4, dp_clip=clip)
    # Execute
    result = edge.handle(_stats_task(cfg.task_config()))
    # Assert: one release of 3 mechanisms at the sums' multiplier (half of epsilon, one release
    # in the run); counts z, feature sums z * C, outer-product sums z * C**2
    z = dp.noise_multiplier(1.0, 1e-5, 1, 3, 0)
    assert edge.ctx.privacy.events == [(z, 3, 1.0)]
    assert drawn == [((K,), z), ((K, D), z * clip), ((K, D * D), z * clip**2)]
    assert result.metrics["dp_epsilon"] == pytest.approx(
        dp.PrivacyLedger().epsilon(1e-5, (z, 3, 1.0))
    )
    stats = result.payloads["stats"]
    assert isinstance(stats, ClassStats)
    assert stats.class_ids.tolist() == [0, 1, 2]
    assert np.linalg.eigvalsh(stats.covariances.astype(np.float64)).min() >= -1e-6
    assert np.array_equal(stats.covariances, stats.covariances.transpose(0, 2, 1))


def test_without_noise_the_statistics_formed_from_the_sums_are_the_class_statistics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prepare: a clip no feature reaches and no noise: what is left is the post-processing
    monkeypatch.setattr(dp, "_gauss", lambda shape, sd, rng, device: torch.zeros(shape))
    edge = _edge()
    cfg = CCVRConfig(dp_epsilon=2.0, dp_releases=1, dp_clip=1e6)
    # Execute
    private = edge.handle(_stats_task(cfg.task_config())).payloads["stats"]
    exact = class_stats(edge.ctx.model, edge.ctx.train, K)
    # Assert
    assert isinstance(private, ClassStats)
    assert private.class_ids.tolist() == exact.class_ids.tolist()
    assert private.counts.tolist() == exact.counts.tolist()
    np.testing.assert_allclose(private.means, exact.means, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(private.covariances, exact.covariances, rtol=1e-3, atol=1e-4)


def test_with_dp_off_the_task_and_the_stats_reply_are_what_they_were() -> None:
    edge = _edge()
    config = CCVRConfig().task_config()
    result = edge.handle(_stats_task(config))
    assert not [k for k in config if k.startswith("dp_")]
    assert result.metrics == {}
    plain = class_stats(edge.ctx.model, edge.ctx.train, K)
    assert pack_payloads(result.payloads) == pack_payloads({"stats": plain})
    assert edge.ctx.privacy.events == []


def _next(seen: queue.Queue[Envelope], kind: type) -> object:
    while True:
        env = seen.get(timeout=120)
        if isinstance(env.body, kind):
            return env.body


def test_a_ccvr_device_trains_by_dp_sgd_then_releases_its_statistics_on_one_budget(
    tmp_path: Path,
) -> None:
    # Prepare: a budget of epsilon 2 over two DP-SGD rounds and the one statistics release
    broker = MemoryBroker()
    seen = device_uplink(broker)
    agent = memory_agent(tmp_path, broker, "ccvr")
    hyper = {"dp_epsilon": 2.0, "dp_releases": 2}
    config = CCVRConfig(local_epochs=1, **hyper).task_config()  # type: ignore[arg-type]
    # Execute: two rounds, the statistics, then statistics again (over the budget)
    replies = []
    for n in (1, 2):
        agent.dispatch(Envelope(body=train_task("ccvr", n, **hyper), sender="coordinator"))
        replies.append(_next(seen, Reply))
    for n in (3, 4):
        agent.dispatch(Envelope(body=_stats_task(config, n), sender="coordinator"))
    stats_reply = _next(seen, Reply)
    refusal = _next(seen, ErrorReply)
    # Assert: the steps were calibrated on their composition with the planned statistics, and
    # the whole run lands on the budget
    events = agent.ctx.privacy.events
    z_s = dp.noise_multiplier(1.0, 1e-5, 1, 3, 0)
    assert events[2] == (z_s, 3, 1.0)
    z_sgd, steps, q = events[0]
    assert q < 1 and events[1] == events[0]
    assert z_sgd == dp_sgd_noise_multiplier(2.0, 1e-5, 2 * steps, q, (z_s, 3, 1.0))
    assert all("weights" in r.payloads for r in replies if isinstance(r, Reply))
    assert isinstance(stats_reply, Reply) and "stats" in stats_reply.payloads
    assert stats_reply.metrics["dp_epsilon"] == pytest.approx(2.0, rel=1e-3)
    assert stats_reply.metrics["dp_epsilon"] <= 2.0 * (1 + 1e-6)
    assert isinstance(refusal, ErrorReply) and refusal.code == "PrivacyBudgetError"
    assert "privacy budget spent: 3 releases" in refusal.reason
