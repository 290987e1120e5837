"""Class-wise statistics of a model over local data (prototypes, feature and logit means)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from edge_agent.trainer import TensorData
from models import Classifier
from protocol.arrays import Encoding
from protocol.payloads import PrototypeSet

__all__ = ["class_prototypes", "prototype_scores", "prototype_table"]


@torch.no_grad()
def class_prototypes(
    model: Classifier,
    data: TensorData,
    num_classes: int,
    batch_size: int = 256,
    encoding: Encoding = "raw",
) -> PrototypeSet:
    """Mean feature per class present in ``data`` (eval mode, whole local set)."""
    was_training = model.training
    model.eval()
    sums: Tensor | None = None
    counts = torch.zeros(num_classes, dtype=torch.long, device=data.x.device)
    for x, y in data.batches(batch_size, None, shuffle=False):
        f = model.forward_features(x).float()
        if sums is None:
            sums = torch.zeros(num_classes, f.shape[1], device=f.device)
        sums.index_add_(0, y, f)
        counts += torch.bincount(y, minlength=num_classes)
    model.train(was_training)
    if sums is None:
        return PrototypeSet(
            np.zeros(0, np.int32),
            np.zeros((0, model.num_features), np.float32),
            np.zeros(0, np.int32),
            encoding=encoding,
        )
    present = (counts > 0).nonzero().flatten()
    means = sums[present] / counts[present].unsqueeze(1).float()
    return PrototypeSet(
        class_ids=present.cpu().numpy(),
        vectors=means.cpu().numpy(),
        counts=counts[present].cpu().numpy(),
        encoding=encoding,
    )


def prototype_table(
    protos: PrototypeSet, num_classes: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Dense ``[C, D]`` table and ``[C]`` validity mask from a sparse prototype set."""
    table = torch.zeros(num_classes, protos.dim, device=device)
    valid = torch.zeros(num_classes, dtype=torch.bool, device=device)
    if protos.class_ids.size:
        ids = torch.as_tensor(protos.class_ids, dtype=torch.long, device=device)
        table[ids] = torch.as_tensor(protos.vectors, device=device)
        valid[ids] = True
    return table, valid


def prototype_scores(features: Tensor, table: Tensor, valid: Tensor) -> Tensor:
    """Negative squared distance to each class prototype; invalid classes never win."""
    d = torch.cdist(features.float(), table.float()).pow(2)
    return (-d).masked_fill(~valid.unsqueeze(0), -1e9)
