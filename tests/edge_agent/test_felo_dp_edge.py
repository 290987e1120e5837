"""Felo with ``same_arch_avg`` under ``hyper.dp``: the model that is averaged trains by DP-SGD,
its per-class sums are taken in one pass after the steps and released through the one release,
both on one budget; a device reports the epsilon spent and stops when it is spent."""

from __future__ import annotations

import dataclasses
import queue
from pathlib import Path

import pytest
import torch

from edge_agent.dp import DpSettings, noise_multiplier
from edge_agent.dp_sgd import DpSgd
from protocol.algorithms.felo import FeloConfig, VeloConfig
from protocol.contract.codec import Envelope
from protocol.contract.messages import ErrorReply, Reply
from protocol.transport.base import MemoryBroker
from tests.helpers_runtime import device_uplink, memory_agent, train_task


def _next(seen: queue.Queue[Envelope], kind: type) -> object:
    while True:
        env = seen.get(timeout=120)
        if isinstance(env.body, kind):
            return env.body


def test_same_arch_avg_is_accepted_under_dp_and_its_sums_get_the_share() -> None:
    mixed = FeloConfig(dp_epsilon=4.0, dp_releases=3, dp_share=0.25)
    alone = FeloConfig(dp_epsilon=4.0, dp_releases=3, same_arch_avg=False)
    mixed_settings, alone_settings = DpSettings.of(mixed), DpSettings.of(alone)
    assert mixed.dp_sgd_trains() and not alone.dp_sgd_trains()
    assert mixed_settings is not None and alone_settings is not None
    assert (mixed_settings.statistics_epsilon, mixed_settings.statistics_releases) == (1.0, 3)
    assert (alone_settings.statistics_epsilon, alone_settings.statistics_releases) == (4.0, 3)
    with pytest.raises(ValueError, match="upload_samples uploads individual features"):
        VeloConfig(dp_epsilon=1.0, upload_samples=2)
    with pytest.raises(ValueError, match=r"dp.share must be in \(0, 1\)"):
        FeloConfig(dp_epsilon=1.0, dp_share=1.0)


def test_a_felo_device_trains_by_dp_sgd_releases_once_per_sample_and_stops_when_spent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a budget of epsilon 2 over two rounds; spy on the release
    from edge_agent.algorithms import base

    releases: list[tuple[int, list[float]]] = []
    real = base.privatize

    def spy(stats, held, contributions, *args):  # type: ignore[no-untyped-def]
        releases.append((contributions, [s.clip for s in stats]))
        return real(stats, held, contributions, *args)

    monkeypatch.setattr(base, "privatize", spy)
    broker = MemoryBroker()
    seen = device_uplink(broker)
    agent = memory_agent(tmp_path, broker, "felo")
    # two local epochs: the training passes would add each sample twice
    cfg = FeloConfig(local_epochs=2, dp_epsilon=2.0, dp_clip=0.5, dp_releases=2).task_config()

    def task(n: int) -> Envelope:
        body = dataclasses.replace(train_task("felo", n), config=cfg)
        return Envelope(body=body, sender="coordinator")

    # Execute: two rounds spend the budget, the third would exceed it
    replies = []
    for n in (1, 2):
        agent.dispatch(task(n))
        replies.append(_next(seen, Reply))
    agent.dispatch(task(3))
    refusal = _next(seen, ErrorReply)
    # Assert: each reply carries the weights and the knowledge, its epsilon covers both
    first, second = replies
    assert isinstance(first, Reply) and isinstance(second, Reply)
    assert {"weights", "knowledge"} <= set(second.payloads)
    assert 0 < first.metrics["dp_epsilon"] < second.metrics["dp_epsilon"]
    assert second.metrics["dp_epsilon"] == pytest.approx(2.0, rel=1e-3)
    assert second.metrics["dp_epsilon"] <= 2.0 * (1 + 1e-6)
    assert first.metrics["dp_epsilon_round"] == first.metrics["dp_epsilon"]
    # each round: the DP-SGD steps (Poisson-sampled), then one release of features, logits
    # and counts at the sums' multiplier (half the budget, two releases, no registration)
    z = noise_multiplier(1.0, 1e-5, 2, 3, 0)
    events = agent.ctx.privacy.events
    assert len(events) == 4
    assert all(q < 1 for _, _, q in events[0::2])
    assert events[1::2] == [(z, 3, 1.0), (z, 3, 1.0)]
    # the sums come from one pass after the steps: each sample added once, clipped to clip
    assert releases == [(1, [0.5, 0.5]), (1, [0.5, 0.5])]
    knowledge = second.payloads["knowledge"]
    assert int(knowledge.counts.max()) <= len(agent.ctx.train)
    assert isinstance(refusal, ErrorReply) and refusal.code == "PrivacyBudgetError"
    assert "privacy budget spent: 4 releases" in refusal.reason and "no more" in refusal.reason


def test_under_dp_sgd_the_kd_loss_is_the_mean_of_each_samples_own_loss(tmp_path: Path) -> None:
    # Prepare: server knowledge for half of the classes, so a batch is partly masked
    agent = memory_agent(tmp_path, MemoryBroker(), "felo")
    felo = agent.algorithm
    felo.cfg = FeloConfig(dp_epsilon=1.0, dp_releases=1, kd_weight=0.7)
    c = agent.ctx.num_classes
    torch.manual_seed(0)
    felo.server_features = torch.randn_like(felo.server_features)  # type: ignore[attr-defined]
    felo.server_logits = torch.randn_like(felo.server_logits)  # type: ignore[attr-defined]
    felo.valid = torch.arange(c) % 2 == 0  # type: ignore[attr-defined]
    y = torch.arange(8) % c
    features = torch.randn(8, agent.ctx.model.num_features)
    logits = torch.randn(8, c)
    x = torch.zeros(8, 1)

    def loss(rows: slice) -> float:
        return float(felo.step_loss(x[rows], y[rows], features[rows], logits[rows]))

    # Execute
    plain = loss(slice(None))
    felo._dp_sgd = DpSgd(1.0, 1.0, 0.5, 2, 4.0)
    batch = loss(slice(None))
    alone = [loss(slice(i, i + 1)) for i in range(8)]
    felo._dp_sgd = None
    # Assert: under DP-SGD the batch loss is the mean of the samples' own losses, which the
    # masked mean of the plain loss is not
    assert batch == pytest.approx(sum(alone) / 8, rel=1e-5)
    assert plain != pytest.approx(batch, rel=1e-3)
