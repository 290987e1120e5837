"""Differential privacy of the per-class sums on the edge: clipping, the Gaussian mechanism's
noise scale, the accountant against the library, a spent budget, and a registration's noised
histogram charged to the same budget."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from dp_accounting import dp_event, rdp
from scipy.stats import norm

from edge_agent.class_stats import ClassMeans
from edge_agent.dp import (
    DpSettings,
    PrivacyBudgetError,
    PrivacyLedger,
    clip_rows,
    noise_multiplier,
    privatize,
    release_counts,
    signal_to_noise,
)


def _exact_delta(epsilon: float, z: float) -> float:
    """The exact delta of one Gaussian mechanism of noise multiplier ``z`` at ``epsilon``
    (Balle and Wang 2018, Theorem 8): an independent check of the accountant's calibration."""
    return float(
        norm.cdf(0.5 / z - epsilon * z) - math.exp(epsilon) * norm.cdf(-0.5 / z - epsilon * z)
    )


def test_clipping_bounds_each_samples_contribution_to_its_class_sum_exactly() -> None:
    # Prepare: rows far beyond the clip, within it, and zero
    torch.manual_seed(0)
    x = torch.cat([torch.randn(50, 8) * 10, torch.randn(50, 8) * 0.01, torch.zeros(1, 8)])
    y = torch.randint(0, 3, (len(x),))
    # Execute
    clipped = clip_rows(x, 0.5)
    # Assert: norms at most the clip; rows within it unchanged; each sample moves its class's
    # sum by exactly its clipped vector
    assert float(clipped.norm(dim=1).max()) <= 0.5 * (1 + 1e-6)
    torch.testing.assert_close(clipped[50:], x[50:])
    for i in (0, 60):
        with_it, without = ClassMeans(3, 8, x.device, 0.5), ClassMeans(3, 8, x.device, 0.5)
        with_it.add(x, y)
        keep = torch.arange(len(x)) != i
        without.add(x[keep], y[keep])
        moved = (with_it.sums - without.sums).norm(dim=1)
        assert float(moved.max()) <= 0.5 * (1 + 1e-5)
        assert float(moved[y[i]]) == pytest.approx(float(clipped[i].norm()), rel=1e-4)


@pytest.mark.parametrize(
    ("epsilon", "delta", "releases", "k"), [(1.0, 1e-5, 1, 1), (8.0, 1e-6, 20, 3)]
)
def test_the_noise_multiplier_meets_the_budget_by_the_library_and_the_exact_formula(
    epsilon: float, delta: float, releases: int, k: int
) -> None:
    z = noise_multiplier(epsilon, delta, releases, k)
    spent = rdp.RdpAccountant()
    spent.compose(dp_event.GaussianDpEvent(z), releases * k)
    assert spent.get_epsilon(delta) == pytest.approx(epsilon, rel=1e-4)
    less = rdp.RdpAccountant()
    less.compose(dp_event.GaussianDpEvent(z * 0.98), releases * k)
    assert less.get_epsilon(delta) > epsilon  # the smallest such z, not any
    if releases * k == 1:  # one Gaussian mechanism: the exact delta is within the target
        assert _exact_delta(epsilon, z) <= delta


def test_privatize_adds_noise_of_the_derived_scale_and_forms_means_after_it() -> None:
    # Prepare: zero data, many dimensions, so that the noise alone is measured
    settings = DpSettings(epsilon=2.0, delta=1e-5, clip=0.7, releases=4)
    held, epochs, dim = [30, 0, 5, 12], 3, 20_000
    sums = ClassMeans(4, dim, torch.device("cpu"), clip=0.7)
    sums.counts += torch.tensor([90, 0, 15, 36])  # epochs x held
    ledger = PrivacyLedger()
    # Execute
    metrics = privatize([sums], held, epochs, settings, ledger)
    # Assert: sd z * E * C on the held classes' sums; nothing of the other
    z = noise_multiplier(2.0, 1e-5, 4, 2)
    sd = sums.sums[[0, 2, 3]].std().item()
    assert sd == pytest.approx(z * epochs * 0.7, rel=0.02)
    assert not sums.sums[1].any()
    counts = sums.counts.tolist()
    assert counts[1] == 0 and all(1 <= counts[c] <= epochs * held[c] for c in (0, 2, 3))
    protos = sums.prototypes()
    assert protos.class_ids.tolist() == [0, 2, 3]  # the held classes, not the noise's
    torch.testing.assert_close(
        torch.as_tensor(protos.vectors), sums.sums[[0, 2, 3]] / sums.counts[[0, 2, 3], None]
    )
    assert metrics["dp_epsilon"] == pytest.approx(ledger.epsilon(1e-5))
    assert metrics["dp_epsilon_round"] == pytest.approx(metrics["dp_epsilon"])


def test_unclipped_statistics_are_never_released() -> None:
    settings = DpSettings(epsilon=2.0, delta=1e-5, clip=0.7, releases=4)
    with pytest.raises(RuntimeError, match="clipped"):
        privatize([ClassMeans(2, 3, torch.device("cpu"))], [1, 1], 1, settings, PrivacyLedger())


def test_the_ledger_composes_like_the_library_persists_and_stops_at_the_budget(
    tmp_path: Path,
) -> None:
    # Prepare: a budget for three releases of two mechanisms each
    settings = DpSettings(epsilon=3.0, delta=1e-5, clip=1.0, releases=3)
    path = tmp_path / "privacy.json"
    ledger = PrivacyLedger(path)
    spent = []
    # Execute: three releases, then a restart
    for _ in range(3):
        z, after = ledger.check(settings, 2)
        ledger.record(z, 2)
        spent.append(after)
    restarted = PrivacyLedger(path)
    # Assert: epsilon as the library composes it, growing to the budget; a fourth refused
    reference = rdp.RdpAccountant()
    reference.compose(dp_event.GaussianDpEvent(noise_multiplier(3.0, 1e-5, 3, 2)), 6)
    assert restarted.epsilon(1e-5) == pytest.approx(reference.get_epsilon(1e-5))
    assert spent == sorted(spent) and spent[-1] == pytest.approx(3.0, rel=1e-4)
    with pytest.raises(PrivacyBudgetError, match=r"privacy budget spent: 3 releases .* no more"):
        restarted.check(settings, 2)


def test_a_noised_registration_is_one_more_mechanism_of_the_budget_and_is_never_redrawn(
    tmp_path: Path,
) -> None:
    # Prepare: a budget for three releases of two mechanisms each, and the registration
    settings = DpSettings(epsilon=3.0, delta=1e-5, clip=1.0, releases=3)
    true = [40, 0, 7, 120, 1, *[30] * 20]  # enough classes that the noise moves some count
    path = tmp_path / "privacy.json"
    ledger = PrivacyLedger(path)
    # Execute: register, restart, register again, then the run's three releases
    registered = release_counts(true, settings, 2, ledger)
    after_registration = ledger.epsilon(1e-5)
    restarted = PrivacyLedger(path)
    again = release_counts(true, settings, 2, restarted)
    for _ in range(3):
        z, _after = restarted.check(settings, 2)
        restarted.record(z, 2)
    # Assert: noised (held classes >= 1, the absent one 0), kept, charged once; the noise is
    # the one z of the whole run, which composes 3 x 2 + 1 mechanisms to the budget
    assert registered != true and again == registered
    assert registered[1] == 0 and all(n >= 1 for c, n in enumerate(registered) if c != 1)
    z = noise_multiplier(3.0, 1e-5, 3, 2, 1)
    assert restarted.events == [(z, 1, 1.0)] + [(z, 2, 1.0)] * 3
    one = rdp.RdpAccountant()
    one.compose(dp_event.GaussianDpEvent(z), 1)
    assert after_registration == pytest.approx(one.get_epsilon(1e-5)) and after_registration > 0
    whole = rdp.RdpAccountant()
    whole.compose(dp_event.GaussianDpEvent(z), 3 * 2 + 1)
    assert restarted.epsilon(1e-5) == pytest.approx(whole.get_epsilon(1e-5))
    assert restarted.epsilon(1e-5) <= 3.0 * (1 + 1e-6)
    assert z > noise_multiplier(3.0, 1e-5, 3, 2)  # the registration costs every release some
    with pytest.raises(PrivacyBudgetError, match="privacy budget spent: 4 releases"):
        restarted.check(settings, 2)


def test_a_registered_histogram_is_noised_at_sensitivity_one() -> None:
    # Prepare: many held classes, so that the noise alone is measured
    settings = DpSettings(epsilon=1.0, delta=1e-5, clip=0.1, releases=2)
    true = [10_000] * 20_000
    # Execute
    registered = release_counts(true, settings, 3, PrivacyLedger())
    # Assert: sd z (a sample moves one count by 1), whatever the clip
    z = noise_multiplier(1.0, 1e-5, 2, 3, 1)
    sd = torch.tensor(registered, dtype=torch.float64).std().item()
    assert sd == pytest.approx(math.sqrt(z**2 + 1 / 12), rel=0.03)  # with the rounding's


def test_the_device_is_told_once_when_its_budget_leaves_its_class_means_mostly_noise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: one class of 16 aligned samples at the clip bound (the best case for the signal)
    settings = DpSettings(epsilon=1.0, delta=1e-5, clip=0.5, releases=10)
    dim, n = 4096, 16
    sums = ClassMeans(2, dim, torch.device("cpu"), clip=0.5)
    sums.sums[0] = 0.5 * n * torch.ones(dim) / math.sqrt(dim)
    sums.counts[0] = n
    true = sums.sums[0].clone()
    ledger = PrivacyLedger()
    # Execute
    with caplog.at_level("WARNING", logger="edgefl.dp"):
        privatize([sums], [n, 0], 1, settings, ledger)
        noise_on_mean = float((sums.sums[0] - true).norm()) / n
        sums.counts[0] = n
        privatize([sums], [n, 0], 1, settings, ledger)
    # Assert: the stated ratio is the one the release has (signal clip, noise on the mean)
    z = noise_multiplier(1.0, 1e-5, 10, 2)
    stated = signal_to_noise(torch.tensor([n, 0]), dim, z)
    assert 0.5 / noise_on_mean == pytest.approx(stated, rel=0.05)
    assert stated < 1
    advice = [r for r in caplog.records if "outweighs the signal" in r.getMessage()]
    assert len(advice) == 1 and f"{stated:.3f}" in advice[0].getMessage()
    # and a budget that leaves the means readable says nothing
    caplog.clear()
    loud = DpSettings(epsilon=1e6, delta=1e-5, clip=0.5, releases=1)
    sums.counts[0] = n
    with caplog.at_level("WARNING", logger="edgefl.dp"):
        privatize([sums], [n, 0], 1, loud, PrivacyLedger())
    assert not [r for r in caplog.records if "outweighs the signal" in r.getMessage()]
