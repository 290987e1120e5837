"""DP-SGD for the weight-exchanging algorithms: the noise multiplier against two accountants,
each sample's gradient clipped over every trained module, models without per-sample gradients
refused, and a device of FedAvg, LG-FedAvg and FML that reports its epsilon and stops when its
budget is spent."""

from __future__ import annotations

import queue
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dp_accounting import dp_event, rdp
from opacus.accountants.utils import get_noise_multiplier

from edge_agent.dp_sgd import DpSgd, dp_sgd_noise_multiplier, per_sample_modules
from models import create_model
from protocol.contract.codec import Envelope
from protocol.contract.messages import ErrorReply, Reply
from protocol.errors import ConfigError
from protocol.transport.base import MemoryBroker
from tests.helpers_runtime import device_uplink, memory_agent, train_task


def _epsilon(z: float, q: float, steps: int, delta: float) -> float:
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), steps)
    return float(accountant.get_epsilon(delta))


@pytest.mark.parametrize(
    ("epsilon", "delta", "steps", "q"), [(1.0, 1e-5, 500, 0.02), (8.0, 1e-5, 2000, 0.1)]
)
def test_the_noise_multiplier_meets_the_budget_by_dp_accounting_and_opacus(
    epsilon: float, delta: float, steps: int, q: float
) -> None:
    z = dp_sgd_noise_multiplier(epsilon, delta, steps, q)
    # dp_accounting: the budget is met, and a slightly smaller z would exceed it (the smallest)
    assert _epsilon(z, q, steps, delta) <= epsilon * (1 + 1e-6)
    assert _epsilon(z * 0.98, q, steps, delta) > epsilon
    # Opacus's own RDP accountant (another implementation) calibrates to the same z
    theirs = get_noise_multiplier(
        target_epsilon=epsilon, target_delta=delta, sample_rate=q, steps=steps
    )
    assert z == pytest.approx(theirs, rel=0.02)


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])  # type: ignore[union-attr]


def test_each_samples_gradient_is_clipped_over_every_trained_module() -> None:
    # Prepare: two models trained on one summed loss (FML's shape), a clip far below the
    # gradients' norms, no noise, so the update is exactly the clipped per-sample mean
    torch.manual_seed(0)
    a = create_model("mlp_s", num_classes=4, in_chans=1, input_size=8)
    b = create_model("mlp_xs", num_classes=4, in_chans=1, input_size=8)
    x, y = torch.rand(6, 1, 8, 8) * 10, torch.randint(0, 4, (6,))
    params = [*a.parameters(), *b.parameters()]
    dp = DpSgd(
        clip=0.05, noise_multiplier=0.0, sample_rate=1.0, steps_per_epoch=1, expected_batch=6.0
    )

    def loss_of(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(a(xs), ys) + F.cross_entropy(b(xs), ys)

    expected = torch.zeros(sum(p.numel() for p in params))
    for i in range(6):  # each sample alone, clipped by hand over both models' parameters
        for p in params:
            p.grad = None
        loss_of(x[i : i + 1], y[i : i + 1]).backward()
        g = torch.cat([_grads(a), _grads(b)])
        assert float(g.norm()) > 0.05  # the clip binds
        expected += g * (0.05 / (float(g.norm()) + 1e-6))
    # Execute: the batch through Opacus's per-sample gradients and our clipping
    dp.attach([a, b])
    for p in params:
        p.grad = None
    loss_of(x, y).backward()
    dp.privatize(params)
    dp.detach()
    # Assert
    got = torch.cat([_grads(a), _grads(b)])
    torch.testing.assert_close(got, expected / 6, rtol=1e-4, atol=1e-7)
    assert all(getattr(p, "grad_sample", None) is None for p in params)


def test_a_model_with_batchnorm_is_refused_with_the_way_out() -> None:
    bn = create_model("cnn_bn3", num_classes=4, in_chans=1, input_size=8)
    with pytest.raises(ConfigError, match="without BatchNorm"):
        per_sample_modules([bn])
    per_sample_modules([create_model("mlp_s", num_classes=4, in_chans=1, input_size=8)])


def test_without_opacus_the_refusal_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opacus.validators", None)  # import raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'edgefl\[privacy\]'"):
        per_sample_modules([create_model("mlp_s", num_classes=4, in_chans=1, input_size=8)])


def test_poisson_batches_draw_each_sample_at_the_sampling_rate() -> None:
    dp = DpSgd.plan(_settings(), samples=400, batch_size=40, epochs=1)
    x, y = torch.zeros(400, 1), torch.arange(400)
    sizes = [len(b) for _ in range(20) for _, b in dp.batches(x, y)]
    assert dp.steps_per_epoch == 10 and dp.sample_rate == pytest.approx(0.1)
    assert len(set(sizes)) > 1  # drawn, not fixed
    assert sum(sizes) / len(sizes) == pytest.approx(40, rel=0.1)


def _settings():  # type: ignore[no-untyped-def]
    from edge_agent.dp import DpSettings

    return DpSettings(epsilon=4.0, delta=1e-5, clip=1.0, releases=3)


# ----- a device of each weight-exchanging algorithm DP-SGD covers ------------------------------
def _next(seen: queue.Queue[Envelope], kind: type) -> object:
    while True:
        env = seen.get(timeout=120)
        if isinstance(env.body, kind):
            return env.body


@pytest.mark.parametrize(
    ("algorithm", "extra"),
    [("fedavg", {}), ("lg_fedavg", {}), ("fml", {"shared_model": "mlp_xs"})],
)
def test_a_device_reports_its_epsilon_and_stops_when_its_budget_is_spent(
    algorithm: str, extra: dict[str, object], tmp_path: Path
) -> None:
    # Prepare: a budget of epsilon 2 over two rounds
    broker = MemoryBroker()
    seen = device_uplink(broker)
    agent = memory_agent(tmp_path, broker, algorithm)
    dp = {"dp_epsilon": 2.0, "dp_clip": 1.0, "dp_releases": 2, **extra}
    # Execute: two rounds spend the budget, the third would exceed it
    replies = []
    for n in (1, 2):
        agent.dispatch(Envelope(body=train_task(algorithm, n, **dp), sender="coordinator"))
        replies.append(_next(seen, Reply))
    agent.dispatch(Envelope(body=train_task(algorithm, 3, **dp), sender="coordinator"))
    refusal = _next(seen, ErrorReply)
    # Assert: epsilon grows to the budget; the refusal names it
    first, second = replies
    assert isinstance(first, Reply) and isinstance(second, Reply)
    assert 0 < first.metrics["dp_epsilon"] < second.metrics["dp_epsilon"]
    assert abs(second.metrics["dp_epsilon"] - 2.0) < 1e-3
    assert "weights" in second.payloads
    assert isinstance(refusal, ErrorReply) and refusal.code == "PrivacyBudgetError"
    assert "privacy budget spent: 2 releases" in refusal.reason
