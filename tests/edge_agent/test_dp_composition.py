"""One budget over both mechanisms: a device whose replies carry DP-SGD-trained weights and
noised per-class sums spends one (epsilon, delta), composed by dp_accounting's RDP accountant;
the sums are calibrated for ``hyper.dp.share`` of it, DP-SGD's steps for the rest of the
composition, and each multiplier is the smallest that meets its target."""

from __future__ import annotations

import pytest
from dp_accounting import dp_event, rdp

from edge_agent.dp import DpSettings, PrivacyBudgetError, PrivacyLedger, noise_multiplier
from edge_agent.dp_sgd import DpSgd, dp_sgd_noise_multiplier

DELTA = 1e-5


def _composed(z_sgd: float, q: float, steps: int, z_stats: float, mechanisms: int) -> float:
    """dp_accounting's own epsilon of the composed event, built here from its classes."""
    sgd = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z_sgd))
    event = dp_event.ComposedDpEvent(
        [
            dp_event.SelfComposedDpEvent(sgd, steps),
            dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(z_stats), mechanisms),
        ]
    )
    accountant = rdp.RdpAccountant()
    accountant.compose(event)
    return float(accountant.get_epsilon(DELTA))


def _settings(epsilon: float = 4.0, share: float = 0.5, releases: int = 3) -> DpSettings:
    return DpSettings(epsilon, DELTA, 1.0, releases, epsilon * share, releases)


def test_the_ledger_composes_dp_sgd_steps_and_statistics_releases_as_dp_accounting_does() -> None:
    # Prepare: k rounds of DP-SGD steps and m releases of 3 sums, interleaved as a run makes them
    ledger = PrivacyLedger()
    z_sgd, q, steps, z_stats, per_release = 1.3, 0.05, 40, 7.5, 3
    # Execute
    for _ in range(3):
        ledger.record(z_sgd, steps, q)
        ledger.record(z_stats, per_release)
    # Assert
    expected = _composed(z_sgd, q, 3 * steps, z_stats, 3 * per_release)
    assert ledger.epsilon(DELTA) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(("epsilon", "share"), [(1.0, 0.5), (4.0, 0.25), (8.0, 0.8)])
def test_the_multipliers_meet_the_budget_and_are_the_smallest_that_do(
    epsilon: float, share: float
) -> None:
    # Prepare: 3 releases of 3 sums and a noised registration; 3 rounds of 2 epochs over 500
    # samples in batches of 25
    settings = _settings(epsilon, share)
    per_release, extra = 3, 1
    # Execute
    planned = settings.planned_statistics(per_release, extra)
    assert planned is not None
    z_stats, mechanisms, _ = planned
    plan = DpSgd.plan(settings, samples=500, batch_size=25, epochs=2, statistics=planned)
    steps = 3 * 2 * plan.steps_per_epoch
    # Assert: the sums alone spend their share, and no less noise would do
    assert mechanisms == 3 * per_release + extra
    assert z_stats == noise_multiplier(epsilon * share, DELTA, 3, per_release, extra)
    alone = PrivacyLedger()
    alone.record(z_stats, mechanisms)
    assert alone.epsilon(DELTA) <= epsilon * share * (1 + 1e-6)
    alone.events = [(z_stats * 0.98, mechanisms, 1.0)]
    assert alone.epsilon(DELTA) > epsilon * share
    # the composition of every planned step and sum meets the whole budget, and no smaller z
    # of the steps does; the steps get more than the rest of a linear split (RDP composes
    # tighter than adding epsilons)
    z_sgd, q = plan.noise_multiplier, plan.sample_rate
    assert _composed(z_sgd, q, steps, z_stats, mechanisms) <= epsilon * (1 + 1e-6)
    assert _composed(z_sgd * 0.98, q, steps, z_stats, mechanisms) > epsilon
    assert z_sgd < dp_sgd_noise_multiplier(epsilon * (1 - share), DELTA, steps, q)


def test_a_run_that_follows_the_plan_lands_on_the_budget_and_its_next_round_is_refused() -> None:
    # Prepare: a device registered its histogram noised, then trains and releases each round
    settings, per_release = _settings(2.0, 0.5, releases=2), 3
    ledger = PrivacyLedger()
    z_reg = settings.statistics_multiplier(per_release, 1)
    ledger.record_registration(z_reg, [5, 7])
    planned = settings.planned_statistics(per_release, ledger.extra_mechanisms)
    assert planned is not None
    plan = DpSgd.plan(settings, samples=400, batch_size=40, epochs=1, statistics=planned)
    this_round = (planned[0], per_release, 1.0)
    # Execute: two rounds of steps then sums, as a Felo round with same_arch_avg spends them
    for _ in range(2):
        plan.spend(settings, ledger, 1, this_round)
        ledger.check(settings, per_release)
        ledger.record(planned[0], per_release)
    # Assert: the whole budget is spent; a third round is refused before its steps are spent
    assert ledger.epsilon(DELTA) == pytest.approx(2.0, rel=1e-3)
    assert ledger.epsilon(DELTA) <= 2.0 * (1 + 1e-6)
    events = list(ledger.events)
    with pytest.raises(PrivacyBudgetError, match="privacy budget spent"):
        plan.spend(settings, ledger, 1, this_round)
    assert ledger.events == events


def test_a_round_is_refused_when_its_steps_fit_but_its_release_of_sums_would_not() -> None:
    # Prepare: one round planned (its steps and one release of sums); a release of sums is
    # already in the ledger, so the round's steps alone exactly meet the budget
    settings, per_release = _settings(2.0, 0.5, releases=1), 3
    planned = settings.planned_statistics(per_release, 0)
    assert planned is not None
    plan = DpSgd.plan(settings, samples=400, batch_size=40, epochs=1, statistics=planned)
    ledger = PrivacyLedger()
    ledger.record(planned[0], per_release)
    steps = (plan.noise_multiplier, plan.steps_per_epoch, plan.sample_rate)
    # Execute / Assert: the steps would fit alone, not with the sums the round's reply
    # releases: refused before anything is spent
    assert ledger.check_event(settings, steps) <= 2.0 * (1 + 1e-6)
    with pytest.raises(PrivacyBudgetError):
        plan.spend(settings, ledger, 1, (planned[0], per_release, 1.0))
    assert ledger.events == [(planned[0], per_release, 1.0)]
