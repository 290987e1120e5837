"""Server-side head training (FedGH, CCVR) and CCVR's virtual features.

Imported lazily by the FedGH and CCVR strategies (torch is loaded only on the server's training
path). A linear head ``Linear(D, C)`` trains with cross-entropy on features the coordinator
holds (FedGH: the uploaded class prototypes; CCVR: virtual features sampled from the global
class statistics) through the one server fit loop (:func:`models.fit.fit`), the step's seeded
generator driving the batch order, the head's first initialisation and the sampling.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from coordinator.strategies.base import ServerContext
from models.fit import fit, resumed, with_row_weights
from models.tensormap import module_to_tensormap
from protocol.algorithms.ccvr import CCVRConfig
from protocol.contract.arrays import Encoding
from protocol.contract.payloads import TensorMap

__all__ = [
    "calibrate_head",
    "fit_head",
    "head_ce_loss",
    "sample_virtual_features",
    "shared_start_head",
]


def head_ce_loss(
    module: nn.Module, batch: tuple[Tensor, ...], gen: torch.Generator
) -> dict[str, Tensor]:
    """Cross-entropy of the head on a batch of (features, labels), with its accuracy; a third
    tensor weighs each row's term (:func:`models.fit.row_weights`)."""
    x, y, *weight = batch
    logits = module(x)
    acc = (logits.argmax(1) == y).float().mean()
    if weight:
        ce = (F.cross_entropy(logits, y, reduction="none") * weight[0]).mean()
    else:
        ce = F.cross_entropy(logits, y)
    return {"loss": ce, "acc": acc.detach()}


def shared_start_head(role: str, num_features: int, num_classes: int) -> TensorMap:
    """The head the ``role`` agents start from with a shared head (their ``shared_head``):
    ``Linear(D, C)`` built under the seed they derive from its shapes, the agents' own recipe,
    so that the server's first head is theirs (HtFLlib's server starts from client 0's)."""
    from models.seeding import head_seed, seeded

    seed = head_seed(role, {"weight": (num_classes, num_features), "bias": (num_classes,)})
    with seeded(seed):  # the global generator, as the agents' draws; restored after
        head = nn.Linear(num_features, num_classes)
    return module_to_tensormap(head)


def fit_head(
    state: TensorMap | None,
    features: npt.NDArray[np.float32],
    labels: npt.NDArray[np.int64],
    *,
    num_classes: int,
    epochs: int,
    batch_size: int,
    lr: float,
    ctx: ServerContext,
    gen: torch.Generator | None = None,
    encoding: Encoding = "raw",
    weights: npt.NDArray[np.float64] | None = None,
) -> tuple[TensorMap, dict[str, float]]:
    """Continue training a ``Linear(D, num_classes)`` head (``weight``, ``bias``; seeded init
    when ``state`` is None) with plain SGD on ``features``, each row's loss term scaled by its
    weight when ``weights`` are given; return its state and metrics."""
    gen = ctx.torch_generator() if gen is None else gen
    head = resumed(lambda: nn.Linear(int(features.shape[1]), num_classes), state, gen, "head state")
    data = (torch.as_tensor(features), torch.as_tensor(labels, dtype=torch.long))
    stats = fit(
        head,
        with_row_weights(data, weights),
        head_ce_loss,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        generator=gen,
        optimizer="sgd",
        device=ctx.device,
    )
    out = module_to_tensormap(head)
    metrics = {f"head_{k}": v for k, v in stats.terms.items()}
    metrics["head_steps"] = float(stats.steps)
    return TensorMap(out.tensors, encoding=encoding), metrics


def sample_virtual_features(
    means: npt.NDArray[np.float64],
    covariances: npt.NDArray[np.float64],
    per_class: int,
    gen: torch.Generator,
) -> npt.NDArray[np.float32]:
    """``per_class`` draws from ``N(mean_c, cov_c)`` per row ``c`` -> ``[K, per_class, D]``.

    Each covariance is symmetrised and its negative eigenvalues (rounding) clipped to zero, so
    every matrix is a valid covariance: ``x = mean + V diag(sqrt(lambda)) eps``.
    """
    cov = torch.as_tensor(covariances, dtype=torch.float64)
    vals, vecs = torch.linalg.eigh((cov + cov.transpose(1, 2)) / 2)
    root = vecs * vals.clamp_min(0).sqrt().unsqueeze(1)  # [K, D, D]: V diag(sqrt(lambda))
    k, d = means.shape
    eps = torch.randn((k, per_class, d), generator=gen, dtype=torch.float64)
    x = torch.as_tensor(means, dtype=torch.float64).unsqueeze(1) + eps @ root.transpose(1, 2)
    out: npt.NDArray[np.float32] = x.numpy().astype(np.float32)
    return out


def calibrate_head(
    head: TensorMap,
    class_ids: npt.NDArray[np.int64],
    means: npt.NDArray[np.float64],
    covariances: npt.NDArray[np.float64],
    *,
    cfg: CCVRConfig,
    ctx: ServerContext,
) -> tuple[TensorMap, dict[str, float]]:
    """CCVR: ``virtual_per_class`` features per class from ``N(mu_c, Sigma_c)``, then the head
    (``weight``, ``bias``) fine-tuned on them with plain SGD."""
    gen = ctx.torch_generator()
    virtual = sample_virtual_features(means, covariances, cfg.virtual_per_class, gen)
    labels = np.repeat(class_ids, cfg.virtual_per_class)
    num_classes = int(head.tensors["weight"].shape[0])
    out, metrics = fit_head(
        head,
        virtual.reshape(-1, virtual.shape[-1]),
        labels,
        num_classes=num_classes,
        epochs=cfg.calib_epochs,
        batch_size=cfg.calib_batch_size,
        lr=cfg.calib_lr,
        ctx=ctx,
        gen=gen,
    )
    metrics["virtual_features"] = float(labels.size)
    return out, metrics
