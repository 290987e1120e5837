"""The one local training loop and the one evaluation loop of every algorithm.

Algorithms never copy this loop: they fill :class:`TrainHooks` (the loss of a step, work after a
step) and declare what trains as :class:`ParamGroup` s. Data lives in memory as tensors on the
training device and is batched by index permutation, which keeps the loop's overhead over bare
PyTorch negligible for edge-sized data.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.optim import adam
from protocol.algorithms import TrainConfig
from protocol.errors import EdgeFLError

if TYPE_CHECKING:
    from edge_agent.dp_sgd import DpSgd

__all__ = [
    "EvalResult",
    "GroupLoss",
    "ParamGroup",
    "TensorData",
    "TrainHooks",
    "TrainStats",
    "TrainingError",
    "TrainingStoppedError",
    "evaluate",
    "make_optimizer",
    "train_epochs",
]

ProgressFn = Callable[[int, int, float], None]  # (step, total_steps, running loss)
# A group's own loss on the batch (x, y); None skips that group's update for this batch.
GroupLoss = Callable[[Tensor, Tensor], Tensor | None]


FIXED_ORDER_SEED = 0  # batch_order = "fixed" without a generator: one order for everyone


class TrainingError(EdgeFLError):
    """Local training diverged or could not run."""


class TrainingStoppedError(EdgeFLError):
    """The agent was told to stop (SIGTERM, SIGINT) during training: the task has no result."""


@dataclass(frozen=True)
class TensorData:
    """Images in [0, 1] and integer labels, already on the training device."""

    x: Tensor
    y: Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def batches(
        self,
        batch_size: int,
        generator: torch.Generator | None,
        shuffle: bool = True,
        *,
        drop_last: bool = False,
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """Mini-batches in a seeded random order (or in order when ``shuffle`` is false);
        ``drop_last`` leaves out a last batch smaller than ``batch_size``."""
        n = len(self)
        order = (torch.randperm(n, generator=generator) if shuffle else torch.arange(n)).to(
            self.x.device
        )
        end = n - n % batch_size if drop_last else n
        for start in range(0, end, batch_size):
            idx = order[start : start + batch_size]
            yield self.x[idx], self.y[idx]


class TrainHooks(Protocol):
    """What an algorithm adds to the loop."""

    def step_loss(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> Tensor:
        """The loss to minimise for this batch (cross-entropy plus the algorithm's terms)."""

    def after_step(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> None:
        """Work after the batch's updates (statistics); ``features``/``logits`` are detached
        and come from the forward pass of ``step_loss``."""


@dataclass(frozen=True)
class ParamGroup:
    """Parameters the loop trains with one optimizer; ``None`` settings take the task config's.

    A group without ``loss`` steps on ``step_loss`` (the main step). A group with a ``loss`` is
    a sub-step after the main update, in declaration order (FedVTC's step B); groups with an
    equal ``loss`` share one sub-step (one evaluation, one backward). Every group of a step is
    clipped and stepped on its own, so splitting parameters into groups clips them separately.
    While a step runs, its groups' modules are in train mode and their parameters take
    gradients; every other group's parameters are frozen and its module is in ``frozen_mode``.
    """

    name: str
    module: nn.Module  # owner: its train/eval mode is set by the loop
    params: Sequence[Tensor] | None = None  # None: every parameter of ``module``
    lr: float | None = None
    grad_clip: float | None = None  # max global norm of this group's gradients; 0 = off
    optimizer: Literal["sgd", "adam"] | None = None
    momentum: float | None = None
    weight_decay: float | None = None
    loss: GroupLoss | None = None
    after_update: Callable[[], None] | None = None  # e.g. project onto a constraint set
    # the module's mode while other groups step: "train" = no gradients but batch statistics
    # (BatchNorm normalises by the batch and updates its running statistics), so a frozen
    # module computes the same function as when it trains (FedVTC's generator in step A)
    frozen_mode: Literal["eval", "train"] = "eval"

    def tensors(self) -> list[Tensor]:
        """The trained tensors, in a fixed order."""
        return list(self.module.parameters()) if self.params is None else list(self.params)


_CONFIG_GROUP = ParamGroup("config", nn.Identity())  # every setting from the task config


@dataclass(frozen=True)
class TrainStats:
    """What one call of :func:`train_epochs` did."""

    steps: int
    samples: int
    mean_loss: float
    seconds: float

    @property
    def samples_per_s(self) -> float:
        """Training throughput."""
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def make_optimizer(
    params: Sequence[Tensor] | Iterator[nn.Parameter],
    cfg: TrainConfig,
    group: ParamGroup | None = None,
) -> torch.optim.Optimizer:
    """SGD (with momentum) or Adam with the group's settings, the config's where it has none."""
    g = group or _CONFIG_GROUP
    kind = g.optimizer or cfg.optimizer
    lr = cfg.lr if g.lr is None else g.lr
    wd = cfg.weight_decay if g.weight_decay is None else g.weight_decay
    if kind == "adam":
        return adam(params, lr, wd)
    momentum = cfg.momentum if g.momentum is None else g.momentum
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=wd)


@dataclass(eq=False)  # compared by identity in _activate
class _Stepper:
    """A group with its optimizer, its clip norm and its tensors' gradient flags on entry."""

    group: ParamGroup
    params: list[Tensor]
    optimizer: torch.optim.Optimizer
    clip: float
    found: list[bool]

    @classmethod
    def of(cls, group: ParamGroup, cfg: TrainConfig) -> _Stepper:
        params = group.tensors()
        clip = cfg.grad_clip if group.grad_clip is None else group.grad_clip
        opt = make_optimizer(params, cfg, group)
        return cls(group, params, opt, clip, [p.requires_grad for p in params])


def _activate(steppers: list[_Stepper], active: list[_Stepper]) -> None:
    """Train mode and gradients for the active groups; the others frozen in their frozen mode.

    A tensor frozen on entry stays frozen: the loop never unfreezes what an algorithm froze.
    """
    for s in steppers:
        on = s in active
        s.group.module.train(on or s.group.frozen_mode == "train")
        for p, flag in zip(s.params, s.found, strict=True):
            p.requires_grad_(on and flag)


def _restore(steppers: list[_Stepper], dp_sgd: DpSgd | None) -> None:
    """Every group's module back in train mode, its tensors with their entry flags, DP-SGD's
    hooks removed."""
    if dp_sgd is not None:
        dp_sgd.detach()
    for s in steppers:
        s.group.module.train()
        for p, flag in zip(s.params, s.found, strict=True):
            p.requires_grad_(flag)


def _update(
    loss: Tensor | None,
    steppers: list[_Stepper],
    scaler: torch.amp.GradScaler | None,
    dp_sgd: DpSgd | None = None,
) -> None:
    """zero_grad, backward, DP-SGD's clipping and noise (``dp_sgd``; ``loss`` None: an empty
    batch, noise alone), per-group clipping, step: the only optimiser step there is."""
    for s in steppers:
        s.optimizer.zero_grad(set_to_none=True)
    if loss is not None:
        scaled = loss if scaler is None else scaler.scale(loss)
        scaled.backward()  # type: ignore[no-untyped-call]  # torch stub
    if dp_sgd is not None:  # one clip over every group of the step: a sample's whole gradient
        dp_sgd.privatize([p for s in steppers for p in s.params])
    for s in steppers:
        if s.clip > 0:
            if scaler is not None:
                scaler.unscale_(s.optimizer)
            nn.utils.clip_grad_norm_(s.params, s.clip)
        if scaler is None:
            s.optimizer.step()
        else:
            scaler.step(s.optimizer)
        if s.group.after_update is not None:
            s.group.after_update()
    if scaler is not None:
        scaler.update()


def _finite(loss: Tensor, step: int, total: int, group: str = "") -> float:
    value = float(loss.detach())  # one device sync per step serves the check and the stats
    if not math.isfinite(value):
        of = f" (group {group!r})" if group else ""
        raise TrainingError(f"loss became {value} at step {step}/{total}{of}")
    return value


def _sub_steps(steppers: list[_Stepper]) -> list[tuple[list[_Stepper], GroupLoss]]:
    """The sub-steps in declaration order: groups with an equal loss (``==``, so two accesses of
    one bound method match) share one sub-step."""
    subs: list[tuple[list[_Stepper], GroupLoss]] = []
    for s in steppers:
        loss = s.group.loss
        if loss is None:
            continue
        shared = next((group for group, fn in subs if fn == loss), None)
        if shared is None:
            subs.append(([s], loss))
        else:
            shared.append(s)
    return subs


def _autocast(use_amp: bool, device: torch.device) -> AbstractContextManager[object]:
    return torch.autocast(device.type) if use_amp else contextlib.nullcontext()


def _start_dp_sgd(
    dp_sgd: DpSgd | None, main: list[_Stepper], subs: Sequence[object], per_epoch: int
) -> int:
    """Attach DP-SGD's per-sample gradients to the main step's modules; the epoch's steps."""
    if dp_sgd is None:
        return per_epoch
    if subs:
        raise TrainingError("DP-SGD covers the main step only; this algorithm has sub-steps")
    dp_sgd.attach([s.group.module for s in main])
    return dp_sgd.steps_per_epoch


def train_epochs(
    model: nn.Module,
    data: TensorData,
    cfg: TrainConfig,
    hooks: TrainHooks,
    *,
    groups: Sequence[ParamGroup] | None = None,
    epochs: int | None = None,
    generator: torch.Generator | None = None,
    on_progress: ProgressFn | None = None,
    on_epoch: Callable[[int], None] | None = None,
    stop: threading.Event | None = None,
    dp_sgd: DpSgd | None = None,
) -> TrainStats:
    """Train ``groups`` (default: all of ``model``) for ``epochs`` (default ``cfg.local_epochs``).

    Per batch: forward ``model``, ``hooks.step_loss``, update the main groups; then each
    sub-step group on its own loss; then ``hooks.after_step``. ``on_epoch(e)`` runs before
    epoch ``e`` (0-based) draws its first batch, after the previous epoch's last update (e.g.
    conformal calibration from a snapshot of the models as they enter the epoch).

    ``dp_sgd``: the main step is DP-SGD's (:mod:`edge_agent.dp_sgd`): Poisson-sampled batches,
    per-sample gradients clipped over all main groups together, Gaussian noise.

    Raises:
        TrainingStoppedError: ``stop`` was set; checked before every batch, so a stop is seen
            within one batch however many epochs the task asked for.
    """
    epochs = cfg.local_epochs if epochs is None else epochs
    steppers = [_Stepper.of(g, cfg) for g in groups or [ParamGroup("model", model)]]
    main = [s for s in steppers if s.group.loss is None]
    subs = _sub_steps(steppers)
    if not main:
        raise TrainingError("no parameter group trains on step_loss")
    use_amp = cfg.mixed_precision and data.x.device.type == "cuda" and dp_sgd is None
    fixed = cfg.batch_order == "fixed"
    fixed_seed = FIXED_ORDER_SEED if generator is None else generator.initial_seed()
    # Without AMP the scaler and autocast are bypassed: on tiny models their per-step Python
    # cost was a measurable share of the step (benchmarks/bench_trainloop.py).
    scaler = torch.amp.GradScaler("cuda") if use_amp else None
    # A last batch of one sample is left out when the epoch has others: BatchNorm cannot take
    # the statistics of one sample in train mode (it raises), and one sample is no estimate of
    # the batch's gradient. A shuffled order leaves out another sample each epoch.
    drop_last = cfg.drop_last or (len(data) > cfg.batch_size and len(data) % cfg.batch_size == 1)
    per_epoch = len(data) // cfg.batch_size if drop_last else math.ceil(len(data) / cfg.batch_size)
    per_epoch = _start_dp_sgd(dp_sgd, main, subs, per_epoch)
    total = epochs * per_epoch
    _activate(steppers, main)
    steps, samples, loss_sum, t0 = 0, 0, 0.0, time.perf_counter()
    try:
        for epoch in range(epochs):
            if on_epoch is not None:
                on_epoch(epoch)
            # "fixed": the same order every epoch and round, drawn from the seed the agent's
            # generator started with (the run's seed and the client), not from its state
            order = torch.Generator().manual_seed(fixed_seed) if fixed else generator
            batches = (
                data.batches(cfg.batch_size, order, drop_last=drop_last)
                if dp_sgd is None
                else dp_sgd.batches(data.x, data.y)
            )
            for x, y in batches:
                if stop is not None and stop.is_set():
                    raise TrainingStoppedError(f"stopped at step {steps + 1} of {total}")
                if not len(y):  # only a Poisson-sampled batch is ever empty: noise alone
                    _update(None, main, None, dp_sgd)
                    continue
                if subs:  # the last sub-step switched modes and gradients to its group
                    _activate(steppers, main)
                with _autocast(use_amp, data.x.device):
                    features = model.forward_features(x)  # type: ignore[operator]
                    logits = model.forward_head(features)  # type: ignore[operator]
                    loss = hooks.step_loss(x, y, features, logits)
                loss_value = _finite(loss, steps + 1, total)
                _update(loss, main, scaler, dp_sgd)
                for sub, sub_loss_fn in subs:  # e.g. a generator against the updated model
                    _activate(steppers, sub)
                    with _autocast(use_amp, data.x.device):
                        sub_loss = sub_loss_fn(x, y)
                    if sub_loss is not None:  # None: nothing to learn from this batch
                        _finite(sub_loss, steps + 1, total, sub[0].group.name)
                        _update(sub_loss, sub, scaler)
                hooks.after_step(x, y, features.detach(), logits.detach())
                steps, samples = steps + 1, samples + int(y.shape[0])
                loss_sum += loss_value
                if on_progress is not None:
                    on_progress(steps, total, loss_sum / steps)
    finally:
        _restore(steppers, dp_sgd)
    seconds = time.perf_counter() - t0
    return TrainStats(steps, samples, loss_sum / steps if steps else 0.0, seconds)


@dataclass(frozen=True)
class EvalResult:
    """Accuracy and mean cross-entropy of a model on a labelled set."""

    accuracy: float
    loss: float
    samples: int


ScoreFn = Callable[[Tensor], Tensor]


@torch.no_grad()
def evaluate(
    model: nn.Module, data: TensorData, scores: ScoreFn | None = None, batch_size: int = 256
) -> EvalResult:
    """Evaluate in eval mode; ``scores`` maps images to class scores (default: ``model``)."""
    if len(data) == 0:
        return EvalResult(float("nan"), float("nan"), 0)
    fn = scores or model
    was_training = model.training
    model.eval()
    correct, loss_sum = 0, 0.0
    for x, y in data.batches(batch_size, None, shuffle=False):
        s = fn(x).float()
        loss_sum += float(F.cross_entropy(s, y, reduction="sum"))
        correct += int((s.argmax(dim=1) == y).sum())
    model.train(was_training)
    n = len(data)
    return EvalResult(correct / n, loss_sum / n, n)
