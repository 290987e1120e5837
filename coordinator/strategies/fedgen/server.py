"""FedGen's server training: the label-conditional feature generator against the heads.

Imported lazily by :class:`coordinator.strategies.fedgen.strategy.FedGenStrategy` (torch is loaded
only
on the server's training path). The generator trains through the one server fit loop
(:func:`models.fit.fit`) over labels drawn from the fleet's label distribution; the step's
seeded generator draws those labels, the noise and the first initialisation, so a resumed step
replays the same generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from coordinator.strategies.base import ServerContext
from models.feature_gen import feature_generator
from models.fit import LossFn, fit, resumed
from models.tensormap import module_to_tensormap
from protocol.algorithms.fedgen import FedGenConfig
from protocol.contract.payloads import TensorMap

__all__ = ["build_generator", "ensemble_loss", "generate", "train_generator"]


build_generator = feature_generator  # the one layout, shared with the other half


def generate(net: nn.Module, labels: Tensor, noise: Tensor, num_classes: int) -> Tensor:
    """Features for ``labels`` ``[B]`` from ``noise`` ``[B, noise_dim]``."""
    return cast(Tensor, net(torch.cat([noise, F.one_hot(labels, num_classes).float()], dim=1)))


def ensemble_loss(
    weights: Tensor, biases: Tensor, mix: Tensor, noise_dim: int, num_classes: int
) -> LossFn:
    """CE of the ``mix``-weighted sum of the heads' logits (``weights`` ``[K, C, D]``,
    ``biases`` ``[K, C]``) on generated features, noise ``U[0, 1)`` as HtFLlib's."""

    def loss(
        module: nn.Module, batch: tuple[Tensor, ...], gen: torch.Generator
    ) -> dict[str, Tensor]:
        (labels,) = batch
        noise = torch.rand((labels.shape[0], noise_dim), generator=gen).to(labels.device)
        z = generate(module, labels, noise, num_classes)
        logits = torch.einsum("bd,kcd->kbc", z, weights) + biases[:, None, :]
        mixed = (mix[:, None, None] * logits).sum(0)
        acc = (mixed.argmax(1) == labels).float().mean()
        return {"loss": F.cross_entropy(mixed, labels), "teacher_acc": acc.detach()}

    return loss


def train_generator(
    state: TensorMap | None,
    heads: Sequence[TensorMap],
    samples: Sequence[float],
    label_counts: npt.NDArray[np.int64],
    *,
    cfg: FedGenConfig,
    ctx: ServerContext,
) -> tuple[TensorMap, dict[str, float]]:
    """Continue training the generator (fresh Adam) for ``cfg.server_steps`` batches against
    the heads weighted by ``samples`` (sample counts, times staleness weights in buffered
    mode); labels follow ``label_counts``."""
    c = int(label_counts.shape[0])
    dev = torch.device(ctx.device)
    weights = torch.stack([torch.as_tensor(h.tensors["weight"]) for h in heads]).to(dev)
    biases = torch.stack([torch.as_tensor(h.tensors["bias"]) for h in heads]).to(dev)
    mix = torch.as_tensor(np.asarray(samples, np.float64) / np.sum(samples), dtype=torch.float32)
    gen = ctx.torch_generator()
    net = resumed(
        lambda: build_generator(cfg.noise_dim, c, cfg.hidden_dim, int(weights.shape[2])),
        state,
        gen,
        "fedgen generator state",
    )
    if cfg.server_steps == 0:
        return module_to_tensormap(net), {}
    prior = torch.as_tensor(label_counts, dtype=torch.float64)
    n = cfg.server_steps * cfg.server_batch_size
    labels = torch.multinomial(prior, n, replacement=True, generator=gen)
    stats = fit(
        net,
        (labels,),
        ensemble_loss(weights, biases, mix.to(dev), cfg.noise_dim, c),
        epochs=1,
        batch_size=cfg.server_batch_size,
        lr=cfg.generator_lr,
        generator=gen,
        optimizer="adam",
        device=dev,
    )
    out = module_to_tensormap(net)
    metrics = {f"generator_{k}": v for k, v in stats.terms.items()}
    metrics["generator_steps"] = float(stats.steps)
    return TensorMap(out.tensors, encoding=cfg.generator_encoding), metrics
