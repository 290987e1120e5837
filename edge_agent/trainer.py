"""The one local training loop and the one evaluation loop of every algorithm.

Algorithms never copy this loop: they fill :class:`TrainHooks` (the loss of a step, work after a
step). Data lives in memory as tensors on the training device and is batched by index
permutation, which keeps the loop's overhead over bare PyTorch negligible for edge-sized data.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protocol.algorithms import TrainConfig
from protocol.errors import EdgeFLError

__all__ = [
    "EvalResult",
    "TensorData",
    "TrainHooks",
    "TrainStats",
    "TrainingError",
    "evaluate",
    "make_optimizer",
    "train_epochs",
]

ProgressFn = Callable[[int, int, float], None]  # (step, total_steps, running loss)


class TrainingError(EdgeFLError):
    """Local training diverged or could not run."""


@dataclass(frozen=True)
class TensorData:
    """Images in [0, 1] and integer labels, already on the training device."""

    x: Tensor
    y: Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def batches(
        self, batch_size: int, generator: torch.Generator | None, shuffle: bool = True
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """Mini-batches in a seeded random order (or in order when ``shuffle`` is false)."""
        n = len(self)
        order = (torch.randperm(n, generator=generator) if shuffle else torch.arange(n)).to(
            self.x.device
        )
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            yield self.x[idx], self.y[idx]


class TrainHooks(Protocol):
    """What an algorithm adds to the loop."""

    def step_loss(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> Tensor:
        """The loss to minimise for this batch (cross-entropy plus the algorithm's terms)."""

    def after_step(self, x: Tensor, y: Tensor, features: Tensor) -> None:
        """Work after the optimizer step (e.g. a second model's update, statistics)."""


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
    params: Iterator[nn.Parameter] | list[nn.Parameter], cfg: TrainConfig
) -> torch.optim.Optimizer:
    """SGD (with momentum) or Adam as the config says."""
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def train_epochs(
    model: nn.Module,
    data: TensorData,
    cfg: TrainConfig,
    hooks: TrainHooks,
    *,
    optimizer: torch.optim.Optimizer,
    epochs: int | None = None,
    generator: torch.Generator | None = None,
    on_progress: ProgressFn | None = None,
) -> TrainStats:
    """Train ``model`` for ``epochs`` (default ``cfg.local_epochs``) over ``data``."""
    epochs = cfg.local_epochs if epochs is None else epochs
    device = data.x.device
    use_amp = cfg.mixed_precision and device.type == "cuda"
    # Without AMP the scaler and autocast are bypassed: on tiny models their per-step Python
    # cost was a measurable share of the step (benchmarks/bench_trainloop.py).
    scaler = torch.amp.GradScaler("cuda") if use_amp else None
    params = [p for g in optimizer.param_groups for p in g["params"]]
    total = epochs * math.ceil(len(data) / cfg.batch_size)
    model.train()
    steps, samples, loss_sum, t0 = 0, 0, 0.0, time.perf_counter()
    for _ in range(epochs):
        for x, y in data.batches(cfg.batch_size, generator):
            with torch.autocast(device.type) if use_amp else contextlib.nullcontext():
                features = model.forward_features(x)  # type: ignore[operator]
                logits = model.forward_head(features)  # type: ignore[operator]
                loss = hooks.step_loss(x, y, features, logits)
            loss_value = float(loss.detach())  # one device sync per step serves both uses
            if not math.isfinite(loss_value):
                raise TrainingError(f"loss became {loss_value} at step {steps + 1}/{total}")
            optimizer.zero_grad(set_to_none=True)
            if scaler is None:
                loss.backward()  # type: ignore[no-untyped-call]  # torch stub
                if cfg.grad_clip > 0:
                    nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                optimizer.step()
            else:
                scaler.scale(loss).backward()  # type: ignore[no-untyped-call]  # torch stub
                if cfg.grad_clip > 0:
                    scaler.unscale_(optimizer)
                    nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                scaler.step(optimizer)
                scaler.update()
            hooks.after_step(x, y, features.detach())
            steps, samples = steps + 1, samples + int(y.shape[0])
            loss_sum += loss_value
            if on_progress is not None:
                on_progress(steps, total, loss_sum / steps)
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
