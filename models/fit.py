"""The one server-side fit loop: every ``server_train`` that trains a network uses it.

Velo's CVAE, FedKTL's feature transformer, FedTGP's and FedGen's generators, FedGH's and CCVR's
heads all train a small module on tensors the coordinator holds. They differ only in the loss,
so this loop owns batching (seeded), the optimiser, clipping, device placement and the
finiteness check, and each algorithm passes a loss function. It lives in ``models`` because the
coordinator must not import ``edge_agent`` (whose loop is the edge's one training loop).

The caller gives a ``torch.Generator``; it drives both the batch order and any noise the loss
draws (passed to the loss function), so a resumed server step replays training exactly.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor, nn

from models.optim import adam
from models.seeding import blank
from models.tensormap import load_tensormap
from protocol.contract.payloads import TensorMap
from protocol.errors import EdgeFLError

__all__ = [
    "FitError",
    "FitStats",
    "LossFn",
    "fit",
    "resumed",
    "row_weights",
    "seeded_init",
    "with_row_weights",
]

# (module, one batch of the tensors, generator for any noise the loss draws) -> named terms;
# the term "loss" is minimised, the others are averaged for logging.
LossFn = Callable[[nn.Module, tuple[Tensor, ...], torch.Generator], dict[str, Tensor]]


def row_weights(weights: Sequence[float] | npt.NDArray[np.float64] | None) -> Tensor | None:
    """Per-row weights of a fit's training set as a tensor to pass beside it, normalised to
    mean 1 (so that the learning rate means the same as unweighted: a loss takes
    ``(term * weight).mean()`` over each batch); None when absent or all equal, where a loss
    takes its plain mean."""
    if weights is None or len(weights) == 0:
        return None
    w = torch.as_tensor(weights, dtype=torch.float64)
    if bool((w == w[0]).all()):
        return None
    return (w / w.mean()).to(torch.float32)


def with_row_weights(
    tensors: tuple[Tensor, ...], weights: Sequence[float] | npt.NDArray[np.float64] | None
) -> tuple[Tensor, ...]:
    """A fit's training set: ``tensors``, and their :func:`row_weights` as one more tensor
    when the weights differ (a loss reads it as the batch's last tensor)."""
    row_weight = row_weights(weights)
    return tensors if row_weight is None else (*tensors, row_weight)


class FitError(EdgeFLError):
    """Server-side training could not run or diverged."""


@dataclass(frozen=True)
class FitStats:
    """What one :func:`fit` call did; ``terms`` are means over its last epoch."""

    epochs: int
    steps: int
    samples: int
    seconds: float
    terms: dict[str, float] = field(default_factory=dict)


def fit(
    module: nn.Module,
    tensors: Sequence[Tensor],
    loss_fn: LossFn,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
    optimizer: Literal["adam", "sgd"] = "adam",
    grad_clip: float = 0.0,
    device: str | torch.device = "cpu",
) -> FitStats:
    """Train ``module`` for ``epochs`` over ``tensors`` (same first dimension) with a fresh
    optimiser; the module is left on ``device`` in train mode."""
    n = _check_tensors(tensors)
    if epochs < 0 or batch_size < 1 or lr <= 0:
        raise FitError(
            f"fit: epochs >= 0, batch_size >= 1, lr > 0 required; got {epochs}, {batch_size}, {lr}"
        )
    dev = torch.device(device)
    module.to(dev).train()
    data = [t.to(dev) for t in tensors]
    params = [p for p in module.parameters() if p.requires_grad]
    opt = adam(params, lr) if optimizer == "adam" else torch.optim.SGD(params, lr=lr)
    # BatchNorm cannot normalise a batch of one sample in train mode: a trailing singleton
    # batch (n % batch_size == 1) is left out of that epoch rather than crash the server step
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())
    steps, skipped, t0 = 0, 0, time.perf_counter()
    sums: dict[str, float] = {}
    for _ in range(epochs):
        sums, batches = {}, 0
        order = torch.randperm(n, generator=generator).to(dev)  # generator stays on the CPU
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            if has_bn and idx.numel() == 1:
                skipped += 1
                continue
            terms = loss_fn(module, tuple(t[idx] for t in data), generator)
            loss = terms["loss"]
            value = float(loss.detach())
            if not math.isfinite(value):
                raise FitError(f"fit: loss became {value} at step {steps + 1}")
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]  # torch stub
            if grad_clip > 0:
                nn.utils.clip_grad_norm_(params, grad_clip)
            opt.step()
            for k, v in terms.items():
                sums[k] = sums.get(k, 0.0) + float(v.detach())
            steps, batches = steps + 1, batches + 1
        sums = {k: v / max(batches, 1) for k, v in sums.items()}
    return FitStats(epochs, steps, n * epochs - skipped, time.perf_counter() - t0, sums)


def _check_tensors(tensors: Sequence[Tensor]) -> int:
    if not tensors:
        raise FitError("fit: no tensors to train on")
    n = int(tensors[0].shape[0])
    if n == 0:
        raise FitError("fit: no samples to train on")
    if n == 1:
        raise FitError("fit: one sample is too few to train on (BatchNorm needs two)")
    bad = [tuple(t.shape) for t in tensors if int(t.shape[0]) != n]
    if bad:
        raise FitError(f"fit: tensors must share their first dimension {n}; got shapes {bad}")
    return n


@torch.no_grad()
def seeded_init(module: nn.Module, gen: torch.Generator) -> None:
    """PyTorch's default initial distributions drawn from ``gen``: Linear U(+-1/sqrt(fan_in)),
    Embedding N(0, 1); BatchNorm keeps its (1, 0). A server module built this way never draws
    from torch's global RNG, which it shares with simulated agents whose seeded inits must not
    see its draws, and a resumed step rebuilds it exactly."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            bound = 1.0 / m.in_features**0.5
            m.weight.copy_(torch.rand(m.weight.shape, generator=gen) * 2 * bound - bound)
            if m.bias is not None:
                m.bias.copy_(torch.rand(m.bias.shape, generator=gen) * 2 * bound - bound)
        elif isinstance(m, nn.Embedding):
            m.weight.copy_(torch.randn(m.weight.shape, generator=gen))


_Module = TypeVar("_Module", bound=nn.Module)


def resumed(
    build: Callable[[], _Module], state: TensorMap | None, gen: torch.Generator, what: str
) -> _Module:
    """A server module that continues across steps: built blank (:func:`models.seeding.blank`),
    then given the previous step's ``state`` (checked; ``what`` names it in errors) or, in the
    first step (``state`` None), weights drawn by :func:`seeded_init` from ``gen``."""
    module = blank(build)
    if state is None:
        seeded_init(module, gen)
    else:
        load_tensormap(module, state, what)
    return module
