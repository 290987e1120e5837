"""A module's state dict as a wire ``TensorMap`` and back: one pair of functions for the edge
(weights that travel) and the coordinator (server-trained modules kept as durable state)."""

from __future__ import annotations

import torch
from torch import nn

from protocol.contract.arrays import Encoding
from protocol.contract.payloads import TensorMap
from protocol.errors import ValidationError

__all__ = ["load_tensormap", "module_to_tensormap"]


def module_to_tensormap(module: nn.Module, encoding: Encoding = "raw") -> TensorMap:
    """The full state dict (BatchNorm buffers and ``num_batches_tracked`` included), on CPU."""
    tensors = {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()}
    return TensorMap(tensors, encoding=encoding)


def load_tensormap(module: nn.Module, tensors: TensorMap, where: str) -> None:
    """Load ``tensors`` into ``module`` after checking names and shapes (``where`` names the
    payload in errors); dtypes follow the module's, e.g. int64 for ``num_batches_tracked``."""
    own = module.state_dict()
    names = set(tensors.tensors)
    if names != set(own):
        missing, unknown = sorted(set(own) - names), sorted(names - set(own))
        raise ValidationError(
            where,
            f"the {len(own)} tensors of this {type(module).__name__}",
            f"{len(names)} tensors; missing {missing[:3]}, unknown {unknown[:3]}",
        )
    for name, value in tensors.tensors.items():
        if tuple(value.shape) != tuple(own[name].shape):
            raise ValidationError(
                f"{where}.{name}", f"shape {list(own[name].shape)}", list(value.shape)
            )
    module.load_state_dict(
        {k: torch.as_tensor(v).to(own[k].dtype) for k, v in tensors.tensors.items()}
    )
