"""DP-SGD for the algorithms whose replies carry model weights (``hyper.dp`` with a config of
``DP_SGD``): every step of the one training loop clips each sample's gradient and adds Gaussian
noise, so the weights that leave the device are a post-processing of private steps.

Opacus computes the per-sample gradients (its ``GradSampleModule`` hooks on every module the
step trains); the clipping, the noise and the accounting are here, because a step may train
several modules with one optimiser each (FML's private model and meme) and a sample's gradient
must be clipped over all of them at once. A step draws its batch by Poisson sampling (each
sample independently with rate ``q = batch_size / n``), which the accountant's
``PoissonSampledDpEvent`` assumes; the batch is drawn, and the noise too, from the operating
system's entropy, never from the run's seed. The sum of the clipped gradients plus noise of
standard deviation ``z * clip`` is divided by the expected batch ``q * n``.

``z`` is calibrated by ``dp_accounting`` so that ``releases`` rounds of ``local_epochs *
ceil(1 / q)`` steps compose to the budget; where the device also releases per-class sums
(Felo's ``same_arch_avg``, CCVR), so that those steps composed with every sum the run plans to
release (noised at their own multiplier, calibrated for ``hyper.dp.share`` of the budget) do.
Each round's steps are one release in the device's :class:`~edge_agent.dp.PrivacyLedger`,
recorded before the round trains.
"""

from __future__ import annotations

import functools
import math
import secrets
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from edge_agent.dp import DpSettings, Event, PrivacyLedger
from protocol.errors import ConfigError

__all__ = ["DpSgd", "dp_sgd_noise_multiplier", "per_sample_modules"]

INSTALL_HINT = "DP-SGD needs Opacus: pip install 'edgefl[privacy]'"


@functools.cache
def dp_sgd_noise_multiplier(
    epsilon: float, delta: float, steps: int, sample_rate: float, statistics: Event | None = None
) -> float:
    """The smallest ``z`` for which ``steps`` Poisson-subsampled (rate ``sample_rate``) Gaussian
    mechanisms of noise multiplier ``z``, composed with the run's planned per-class
    ``statistics`` (``(z_s, mechanisms, 1)``: Gaussian mechanisms of their own multiplier,
    :meth:`~edge_agent.dp.DpSettings.planned_statistics`), compose to ``(epsilon, delta)``, by
    the RDP accountant."""
    import dp_accounting
    from dp_accounting import dp_event, rdp

    def event(z: float) -> dp_event.DpEvent:
        step = dp_event.GaussianDpEvent(z)
        if sample_rate < 1:
            step = dp_event.PoissonSampledDpEvent(sample_rate, step)
        steps_event = dp_event.SelfComposedDpEvent(step, steps)
        if statistics is None:
            return steps_event
        z_s, mechanisms, _ = statistics
        sums = dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(z_s), mechanisms)
        return dp_event.ComposedDpEvent([steps_event, sums])

    z = dp_accounting.calibrate_dp_mechanism(rdp.RdpAccountant, event, epsilon, delta)
    return float(z)


def per_sample_modules(modules: Sequence[nn.Module]) -> None:
    """Refuse modules Opacus cannot compute per-sample gradients of (BatchNorm mixes the samples
    of a batch), naming the layers and the way out."""
    try:
        from opacus.validators import ModuleValidator
    except ImportError as exc:
        raise ConfigError(INSTALL_HINT) from exc
    errors = [str(e) for m in modules for e in ModuleValidator.validate(m, strict=False)]
    if errors:
        raise ConfigError(
            "hyper.dp trains this algorithm's weights by DP-SGD, which needs each sample's own "
            f"gradient; the model cannot give it: {'; '.join(errors[:3])}. Choose a model "
            "without BatchNorm (an mlp_* or a cnn_* without bn; GroupNorm is fine)"
        )


@dataclass
class DpSgd:
    """One round's DP-SGD: its sampling rate, noise multiplier and steps."""

    clip: float
    noise_multiplier: float
    sample_rate: float
    steps_per_epoch: int
    expected_batch: float
    _rng: torch.Generator = field(repr=False, default_factory=torch.Generator)
    _hooks: list[Any] = field(repr=False, default_factory=list)

    @classmethod
    def plan(
        cls,
        settings: DpSettings,
        samples: int,
        batch_size: int,
        epochs: int,
        statistics: Event | None = None,
    ) -> DpSgd:
        """The calibration for ``settings.releases`` rounds of ``epochs`` epochs each over
        ``samples`` samples in batches of ``batch_size`` (expected), composed with the run's
        planned per-class ``statistics`` where the device releases them too."""
        q = min(1.0, batch_size / max(1, samples))
        per_epoch = math.ceil(1 / q)
        steps = settings.releases * max(1, epochs) * per_epoch
        z = dp_sgd_noise_multiplier(settings.epsilon, settings.delta, steps, q, statistics)
        rng = torch.Generator().manual_seed(secrets.randbits(63))
        return cls(settings.clip, z, q, per_epoch, q * samples, rng)

    def spend(
        self,
        settings: DpSettings,
        ledger: PrivacyLedger,
        epochs: int,
        statistics: Event | None = None,
    ) -> dict[str, float]:
        """Account this round's steps before they run; the reply's ``dp_epsilon`` figures.
        ``statistics``: the release of per-class sums the round's reply makes after the steps,
        checked with them (recorded by its own release), so that a round never trains on a
        budget its release would then exceed.

        Raises:
            PrivacyBudgetError: the round would exceed the budget (nothing is spent).
        """
        event = (self.noise_multiplier, max(1, epochs) * self.steps_per_epoch, self.sample_rate)
        before = ledger.epsilon(settings.delta)
        after = ledger.check_event(settings, event, *([statistics] if statistics else []))
        ledger.record(*event)
        return {"dp_epsilon": after, "dp_epsilon_round": after - before}

    def batches(self, x: Tensor, y: Tensor) -> Iterator[tuple[Tensor, Tensor]]:
        """One epoch of Poisson-sampled batches (an empty one is possible and must be noised
        like any other: skipping it would tell that no sample was drawn)."""
        for _ in range(self.steps_per_epoch):
            pick = torch.rand(len(y), generator=self._rng) < self.sample_rate
            idx = pick.nonzero().squeeze(1).to(x.device)
            yield x[idx], y[idx]

    def attach(self, modules: Sequence[nn.Module]) -> None:
        """Per-sample gradients (``p.grad_sample``) for every trained layer of ``modules``."""
        try:
            from opacus import GradSampleModule
        except ImportError as exc:
            raise ConfigError(INSTALL_HINT) from exc
        per_sample_modules(modules)
        # the images take no gradient, so torch says the backward hooks see only the modules'
        # outputs: what per-sample gradients of the parameters need, not a fault
        warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
        # the hooks sit on the layers themselves, so the algorithm's own calls of the module
        # (forward_features, forward_head, a shared model called in step_loss) record them
        self._hooks = [GradSampleModule(m, loss_reduction="mean", strict=False) for m in modules]

    def detach(self) -> None:
        """Remove the hooks and what they left on the layers and tensors."""
        for gsm in self._hooks:
            gsm.remove_hooks()
            for layer in gsm._module.modules():
                layer.__dict__.pop("activations", None)
                layer.__dict__.pop("max_batch_len", None)
            for p in gsm._module.parameters():
                p.grad_sample = None  # type: ignore[attr-defined]  # Opacus's per-sample slot
        self._hooks = []

    def privatize(self, params: Sequence[Tensor]) -> None:
        """Replace the batch gradient of ``params`` by the noised mean of the clipped per-sample
        gradients (all of ``params`` clipped together); a parameter without a per-sample
        gradient (no layer of it ran) counts as zero for every sample."""
        trained = [p for p in params if p.requires_grad]
        samples = [getattr(p, "grad_sample", None) for p in trained]
        for p, gs in zip(trained, samples, strict=True):
            if gs is None and p.grad is not None and bool(p.grad.any()):
                raise ConfigError(
                    f"DP-SGD: a parameter of shape {tuple(p.shape)} has a gradient but no "
                    "per-sample gradient (a layer Opacus does not support)"
                )
        present = [gs.flatten(1) for gs in samples if gs is not None]
        if present:
            norms = torch.cat(present, dim=1).norm(dim=1)
            factor = torch.clamp(self.clip / (norms + 1e-6), max=1.0)
        for p, gs in zip(trained, samples, strict=True):
            total = torch.zeros_like(p) if gs is None else torch.einsum("i,i...->...", factor, gs)
            noise = torch.randn(p.shape, generator=self._rng) * (self.noise_multiplier * self.clip)
            p.grad = (total + noise.to(p.device, p.dtype)) / self.expected_batch
            p.grad_sample = None  # type: ignore[attr-defined]  # Opacus's per-sample slot
