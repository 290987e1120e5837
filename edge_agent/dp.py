"""Differential privacy of the per-class statistics a reply carries: the one place of the
Gaussian mechanism on the edge, and the device's privacy accountant.

A release is a group of per-class sums (prototypes' features, FD's logits, Felo's features and
logits, CCVR's features and their outer products) with their per-class counts. Each sample's
contribution to its class's sum is clipped to L2 norm ``C`` (``hyper.dp.clip``,
:func:`clip_rows`, applied by :class:`~edge_agent.class_stats.ClassMeans` as it adds; FedKTL's
unit-norm embeddings are bounded by ``C = 1`` already; CCVR's outer products by ``C**2``), and a
sample is added at most ``E`` times (once per local epoch for statistics of the training passes,
once for a pass over the data set). Adding or removing one sample then moves one class's sum by
at most ``E * C`` in L2 norm and one count by at most ``E``: the L2 sensitivities.
:func:`privatize` adds Gaussian noise of standard deviation ``z * E * C`` to every sum and
``z * E`` to every count, and forms each mean after noising (the count rounded and floored at 1).
Every noised quantity is a Gaussian mechanism of noise multiplier ``z``; a release of ``k`` of
them composes ``k``, and the device's releases compose over the run. The composition and the
calibration of ``z`` are Google's ``dp_accounting`` RDP accountant's, not formulas of ours
(``docs/concepts/privacy.md`` derives the rest).

Where the run's algorithm reads each device's label histogram, the registration sends it noised
too (:func:`release_counts`): one more Gaussian mechanism of the same ``z``, in the calibration
and in the ledger.

Where a device's replies also carry weights DP-SGD trains (:mod:`edge_agent.dp_sgd`: Felo's
``same_arch_avg``, CCVR), both spend one budget in one ledger: the sums' ``z`` is calibrated for
``hyper.dp.share`` of it (:attr:`DpSettings.statistics_epsilon`, over the releases of sums the
run makes, :attr:`DpSettings.statistics_releases`), and DP-SGD's for the composition of its
steps with every planned sum (:meth:`DpSettings.planned_statistics`) to the whole of it.

The noise is drawn from a generator seeded from the operating system's entropy, never from the
run's seed: noise the coordinator could regenerate would protect nothing.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from edge_agent.state import atomic_write
from protocol.errors import EdgeFLError, ProtocolError

if TYPE_CHECKING:
    from edge_agent.class_stats import ClassMeans

__all__ = [
    "DpSettings",
    "Event",
    "PrivacyBudgetError",
    "PrivacyLedger",
    "clip_rows",
    "noise_multiplier",
    "privatize",
    "public_bounds",
    "release_counts",
]


#: One release in the ledger: (noise multiplier, mechanisms composed, Poisson sampling rate).
Event = tuple[float, int, float]


class PrivacyBudgetError(EdgeFLError):
    """The device's next release would exceed its privacy budget: it contributes no more."""


@dataclass(frozen=True)
class DpSettings:
    """The run's ``hyper.dp``: total budget ``epsilon`` at ``delta``, clip ``clip``, spread
    over ``releases`` releases; the per-class sums' part of the plan: the epsilon their noise
    is calibrated for (``statistics_epsilon``, None: all of ``epsilon``) and how many releases
    of them the run makes (``statistics_releases``, None: ``releases``; 0: none)."""

    epsilon: float
    delta: float
    clip: float
    releases: int
    statistics_epsilon: float | None = None
    statistics_releases: int | None = None

    @classmethod
    def of(cls, config: Any) -> DpSettings | None:
        """The settings of a task's config (``None``: differential privacy is off)."""
        if not getattr(config, "dp_epsilon", 0.0):
            return None
        releases = max(1, int(config.dp_releases))
        return cls(
            float(config.dp_epsilon),
            float(config.dp_delta),
            config.dp_clip,
            releases,
            float(config.dp_statistics_epsilon()),
            int(config.dp_statistics_releases(releases)),
        )

    def statistics_multiplier(self, per_release: int, extra: int) -> float:
        """The noise multiplier of every per-class sum and count the device releases: the
        smallest for which the run's releases of ``per_release`` mechanisms, and ``extra``
        more (a noised registration's histogram), compose to the sums' part of the budget."""
        epsilon = self.epsilon if self.statistics_epsilon is None else self.statistics_epsilon
        releases = self.releases if self.statistics_releases is None else self.statistics_releases
        return noise_multiplier(epsilon, self.delta, max(1, releases), per_release, extra)

    def planned_statistics(self, per_release: int, extra: int) -> Event | None:
        """Every per-class sum and count the run plans this device to release, as one event
        (``None``: it releases none): what DP-SGD's calibration composes its steps with."""
        if self.statistics_releases == 0:
            return None
        releases = self.releases if self.statistics_releases is None else self.statistics_releases
        z = self.statistics_multiplier(per_release, extra)
        return (z, releases * per_release + extra, 1.0)


def clip_rows(x: Tensor, clip: float) -> Tensor:
    """Each row of ``x`` scaled to L2 norm at most ``clip`` (rows within it unchanged)."""
    norms = x.norm(dim=1, keepdim=True)
    return x * torch.clamp(clip / norms.clamp_min(1e-12), max=1.0)


@functools.cache
def noise_multiplier(
    epsilon: float, delta: float, releases: int, per_release: int, extra: int = 0
) -> float:
    """The smallest ``z`` for which ``releases`` releases of ``per_release`` Gaussian mechanisms
    of noise multiplier ``z``, and ``extra`` more (a noised registration's histogram), compose
    to ``(epsilon, delta)``, by the RDP accountant."""
    import dp_accounting
    from dp_accounting import dp_event, rdp

    mechanisms = releases * per_release + extra

    def event(z: float) -> dp_event.DpEvent:
        return dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(z), mechanisms)

    z = dp_accounting.calibrate_dp_mechanism(rdp.RdpAccountant, event, epsilon, delta)
    return float(z)


class PrivacyLedger:
    """The device's accountant: every release's mechanisms, composed by ``dp_accounting``'s
    RDP accountant, kept in ``path`` (written before the release leaves, so that a restart
    never forgets one)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        # per release: (noise multiplier z, mechanisms, sampling rate q); q = 1 is a Gaussian
        # mechanism on the whole data (a statistics release), q < 1 a Poisson-subsampled one
        # (a DP-SGD step, edge_agent.dp_sgd): one accountant composes both kinds
        self.events: list[tuple[float, int, float]] = []
        # the label histogram this device registered noised (release_counts), once for the
        # run: every registration sends it again, since fresh noise each time would average out
        self.registered: list[int] | None = None
        self.advised = False  # the device log's signal-to-noise advice, given once a process
        if path is not None and path.exists():
            self.events, self.registered = _load(path)

    @property
    def extra_mechanisms(self) -> int:
        """Mechanisms released outside the per-round releases: 1 for a noised registration."""
        return 0 if self.registered is None else 1

    def epsilon(self, delta: float, *extra: Event) -> float:
        """Epsilon at ``delta`` spent by the releases so far (and ``extra``, if given)."""
        from dp_accounting import dp_event, rdp

        events = [*self.events, *extra]
        if not events:
            return 0.0
        accountant = rdp.RdpAccountant()
        for z, count, q in events:
            gauss = dp_event.GaussianDpEvent(z)
            accountant.compose(gauss if q >= 1 else dp_event.PoissonSampledDpEvent(q, gauss), count)
        return float(accountant.get_epsilon(delta))

    def check(self, settings: DpSettings, per_release: int) -> tuple[float, float]:
        """``(z, epsilon after one more release)``; raise :class:`PrivacyBudgetError` if that
        release would exceed the budget. The tolerance is the calibration's: the last planned
        release lands on the budget, not above it."""
        z = settings.statistics_multiplier(per_release, self.extra_mechanisms)
        self.check_event(settings, (z, per_release, 1.0))
        return z, self.epsilon(settings.delta, (z, per_release, 1.0))

    def check_event(self, settings: DpSettings, *events: Event) -> float:
        """Epsilon after one more release of ``events`` (a round's DP-SGD steps and its
        statistics, checked together before either is spent); raise
        :class:`PrivacyBudgetError` if that exceeds the budget."""
        after = self.epsilon(settings.delta, *events)
        if after > settings.epsilon * (1 + 1e-6):
            spent = self.epsilon(settings.delta)
            raise PrivacyBudgetError(
                f"privacy budget spent: {len(self.events)} releases used epsilon {spent:.4g} "
                f"of hyper.dp.epsilon {settings.epsilon:g} (delta {settings.delta:g}); one "
                f"more would reach {after:.4g}, so this device contributes no more to the run"
            )
        return after

    def record(self, z: float, per_release: int, sample_rate: float = 1.0) -> None:
        """Account one release (durably, before it leaves)."""
        self.events.append((z, per_release, sample_rate))
        self._save()

    def record_registration(self, z: float, counts: list[int]) -> None:
        """Account the registration's noised histogram ``counts`` (one Gaussian mechanism) and
        keep it for every later registration (durably, before it leaves)."""
        self.events.append((z, 1, 1.0))
        self.registered = list(counts)
        self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        data: dict[str, Any] = {"events": self.events}
        if self.registered is not None:
            data["registered"] = self.registered
        atomic_write(self.path, json.dumps(data).encode())


def _load(path: Path) -> tuple[list[Event], list[int] | None]:
    try:
        data = json.loads(path.read_text())
        # an event of two numbers (z, count) is a Gaussian mechanism on all the data (q = 1)
        events = [
            (float(e[0]), int(e[1]), float(e[2]) if len(e) > 2 else 1.0) for e in data["events"]
        ]
        registered = data.get("registered")
        counts = None if registered is None else [int(n) for n in registered]
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise ProtocolError(f"privacy ledger {path} is unreadable: {exc}") from exc
    if any(not (math.isfinite(z) and z > 0 and n > 0 and 0 < q <= 1) for z, n, q in events):
        raise ProtocolError(f"privacy ledger {path}: invalid events")
    if counts is not None and (min(counts, default=0) < 0 or not events):
        raise ProtocolError(f"privacy ledger {path}: invalid registered counts")
    return events, counts


def release_counts(
    counts: Sequence[int], settings: DpSettings, per_release: int, ledger: PrivacyLedger
) -> list[int]:
    """The label histogram ``counts`` as a registration may send it under ``settings``: the
    ledger's, if this device registered one already; else noised now, accounted, and kept.

    One sample changes one count by 1, so the histogram's L2 sensitivity is 1: each count gets
    Gaussian noise of standard deviation ``z``, the noise multiplier of the run's releases
    calibrated with this one more mechanism (:func:`noise_multiplier`'s ``extra``), so the
    releases that follow still compose to the budget. Each count is rounded, and floored at 1
    for a class the device holds and set to 0 for one it does not: the class set is what every
    registration discloses, and a class registered with 0 could never be released.

    Raises:
        PrivacyBudgetError: the ledger already spent too much for one more mechanism.
    """
    if ledger.registered is not None:
        return list(ledger.registered)
    z = settings.statistics_multiplier(per_release, 1)
    ledger.check_event(settings, (z, 1, 1.0))
    rng = torch.Generator(device="cpu").manual_seed(secrets.randbits(63))
    true = torch.tensor(list(counts), dtype=torch.float32)
    noisy = torch.round(true + torch.randn(true.shape, generator=rng) * z)
    held = torch.where(true > 0, torch.clamp(noisy, min=1.0), torch.zeros_like(noisy))
    released = [int(n) for n in held.tolist()]
    ledger.record_registration(z, released)
    return released


def public_bounds(class_counts: Sequence[int]) -> list[int]:
    """Per-class caps on released counts that disclose nothing beyond a registration of the
    class set and the total: the total for each class the device holds, 0 for the others."""
    total = sum(class_counts)
    return [total if n > 0 else 0 for n in class_counts]


def privatize(
    stats: Sequence[ClassMeans],
    held: Sequence[int],
    contributions: int,
    settings: DpSettings,
    ledger: PrivacyLedger,
) -> dict[str, float]:
    """Noise ``stats`` in place for release: every sum of a class the device holds
    (``held[c] > 0``), at the L2 bound its vectors were clipped to (``ClassMeans.clip``), and
    their shared counts, which become integers in ``[1, contributions * held[c]]`` (0 for other
    classes, so that the released class set is the registered one). ``held`` must be public (the
    registered histogram, or :func:`public_bounds`): a cap at the true counts would release them.
    Returns the reply's metrics: ``dp_epsilon`` (spent in all, this release
    included) and ``dp_epsilon_round`` (this release's share).

    Raises:
        PrivacyBudgetError: the release would exceed the budget (nothing is noised or spent).
    """
    if any(s.clip <= 0 for s in stats):
        raise RuntimeError("privatize: the statistics were not clipped (ClassMeans.clip is 0)")
    per_release = len(stats) + 1  # each sum, and the counts
    before = ledger.epsilon(settings.delta)
    z, after = ledger.check(settings, per_release)
    ledger.record(z, per_release)
    first = stats[0]
    device = first.sums.device
    e = float(max(1, contributions))
    _advise(ledger, stats, z * e, settings)
    rng = torch.Generator(device="cpu").manual_seed(secrets.randbits(63))
    upper = torch.tensor(held, dtype=torch.float32, device=device) * e
    mine = upper > 0
    noisy = first.counts.float() + _gauss(first.counts.shape, z * e, rng, device)
    counts = torch.where(mine, torch.clamp(torch.round(noisy), min=1.0), torch.zeros_like(noisy))
    counts = torch.minimum(counts, upper).long()
    for s in stats:
        # each sum's own bound: hyper.dp.clip, or a tighter one its vectors already meet
        # (FedKTL's unit embeddings: 1)
        s.sums += _gauss(tuple(s.sums.shape), z * e * s.clip, rng, device)
        s.sums[~mine] = 0.0
        s.counts.copy_(counts)
    return {"dp_epsilon": after, "dp_epsilon_round": after - before}


def signal_to_noise(counts: Tensor, dim: int, noise_sd: float) -> float:
    """The best-case signal-to-noise ratio of a released class mean at the median count of
    the classes held: every clipped vector at the bound and aligned (signal ``clip``) against
    the noise on the mean (``noise_sd * clip * sqrt(dim) / n``, ``noise_sd`` in units of the
    clip). Below 1 the noise outweighs anything the mean can carry."""
    held = counts[counts > 0].float()
    if held.numel() == 0:
        return math.inf
    return float(held.quantile(0.5)) / (noise_sd * math.sqrt(dim))


def _advise(
    ledger: PrivacyLedger, stats: Sequence[ClassMeans], noise_sd: float, settings: DpSettings
) -> None:
    """Say once, in the device's own log, when the budget leaves the released means mostly
    noise. The ratio comes from the true counts, so it never leaves the device."""
    if ledger.advised:
        return
    ledger.advised = True
    worst = min(signal_to_noise(s.counts, s.sums[0].numel(), noise_sd) for s in stats)
    if worst < 1:
        logging.getLogger("edgefl.dp").warning(
            "hyper.dp: at epsilon %g the noise outweighs the signal of this device's class "
            "means (best-case signal-to-noise %.3f at the median class count): the run may "
            "learn little from them; a larger epsilon, fewer rounds or the server's "
            "count-weighted means raise it, and a device that predicts by the server's "
            'prototypes keeps the noise out of its predictions with hyper.predict = "head" '
            "(docs/concepts/privacy.md, choosing a budget)",
            settings.epsilon,
            worst,
        )


def _gauss(shape: tuple[int, ...], sd: float, rng: torch.Generator, device: torch.device) -> Tensor:
    return (torch.randn(shape, generator=rng) * sd).to(device)
