"""FedTGP's server training: the trainable global prototypes and their adaptive-margin loss.

Imported lazily by :class:`coordinator.strategies.fedtgp.strategy.FedTGPStrategy` (torch is loaded
only
on the server's training path). Training goes through the one server fit loop
(:func:`models.fit.fit`) with the step's seeded generator driving the batch order, so a resumed
step replays the same prototypes. :func:`models.fit.seeded_init` is also used by FedGen's and CCVR's
servers: a fresh network's initial weights come from the step's generator, never from torch's
global RNG, which simulated agents in the same process draw from.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from coordinator.strategies.base import ServerContext
from models.fit import LossFn, fit, resumed, with_row_weights
from models.tensormap import module_to_tensormap
from protocol.algorithms.fedtgp import FedTGPConfig
from protocol.contract.payloads import TensorMap

__all__ = [
    "TrainablePrototypes",
    "acl_loss",
    "train_prototypes",
]


class TrainablePrototypes(nn.Module):
    """Class id -> global prototype: embedding, ``Linear + ReLU``, ``Linear`` (HtFLlib's TGP)."""

    def __init__(self, num_classes: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_classes, dim)
        self.middle = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU())
        self.fc = nn.Linear(hidden, dim)

    def forward(self, class_ids: Tensor) -> Tensor:
        """``[K]`` ids -> ``[K, dim]`` prototypes."""
        return self.fc(self.middle(self.embedding(class_ids)))  # type: ignore[no-any-return]


def acl_loss(num_classes: int, margin: float) -> LossFn:
    """Adaptive-margin contrastive loss: cross-entropy over negative Euclidean distances from
    each uploaded prototype to every class's trainable prototype, its own class's distance
    increased by ``margin``. A batch of three tensors carries each pair's weight (mean 1 over
    the round's pairs): the loss is then the mean of the weighted per-pair terms."""

    def loss(
        module: nn.Module, batch: tuple[Tensor, ...], gen: torch.Generator
    ) -> dict[str, Tensor]:
        protos, y, *weight = batch
        centers = module(torch.arange(num_classes, device=protos.device))
        sq = (protos.pow(2).sum(1, keepdim=True) - 2 * protos @ centers.T) + centers.pow(2).sum(1)
        dist = sq.clamp_min(1e-12).sqrt()  # the clamp keeps the gradient finite at distance 0
        logits = -(dist + margin * F.one_hot(y, num_classes))
        if weight:
            ce = (F.cross_entropy(logits, y, reduction="none") * weight[0]).mean()
        else:
            ce = F.cross_entropy(logits, y)
        return {
            "loss": ce,
            "own_distance": dist.gather(1, y[:, None]).mean(),
        }

    return loss


def train_prototypes(
    state: TensorMap | None,
    vectors: npt.NDArray[np.float32],
    labels: npt.NDArray[np.int64],
    *,
    margin: float,
    num_classes: int,
    cfg: FedTGPConfig,
    ctx: ServerContext,
    weights: npt.NDArray[np.float64] | None = None,
) -> tuple[TensorMap, npt.NDArray[np.float32], dict[str, float]]:
    """Continue training the TGP (fresh SGD) on the round's uploaded prototypes, each pair's
    loss term scaled by its weight when ``weights`` are given (:func:`models.fit.row_weights`);
    return its state and the ``[num_classes, dim]`` global prototypes it now generates."""
    dim = int(vectors.shape[1])
    gen = ctx.torch_generator()
    tgp = resumed(
        lambda: TrainablePrototypes(num_classes, dim, cfg.tgp_hidden_dim or dim),
        state,
        gen,
        "fedtgp state",
    )
    data = (torch.as_tensor(vectors), torch.as_tensor(labels, dtype=torch.long))
    stats = fit(
        tgp,
        with_row_weights(data, weights),
        acl_loss(num_classes, margin),
        epochs=cfg.server_epochs,
        batch_size=cfg.server_batch_size,
        lr=cfg.server_lr,
        generator=gen,
        optimizer="sgd",
        device=ctx.device,
    )
    tgp.eval()
    with torch.no_grad():
        protos = tgp(torch.arange(num_classes, device=ctx.device)).cpu().numpy()
    metrics = {f"tgp_{k}": v for k, v in stats.terms.items()}
    metrics["tgp_steps"] = float(stats.steps)
    return module_to_tensormap(tgp), protos.astype(np.float32), metrics
