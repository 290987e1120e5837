"""Weights on the wire (``models.tensormap``: a module's state dict as a ``TensorMap`` and
back), and the edge half of any algorithm that averages one module's weights (FedAvg: the model;
LG-FedAvg: the head; FedType: the proxy).
"""

from __future__ import annotations

import copy
from typing import ClassVar, TypeVar

from torch import nn

from edge_agent.algorithms.base import (
    EdgeAlgorithm,
    SharedModule,
    TaskPayloads,
    received,
    task_payloads,
)
from models.seeding import SHARED_MODEL_SEED, head_seed
from models.tensormap import load_tensormap, module_to_tensormap
from protocol.algorithms import TrainConfig
from protocol.contract.arrays import Encoding
from protocol.contract.payloads import Payload, TensorMap

__all__ = [
    "SHARED_MODEL_SEED",
    "WeightExchangeEdge",
    "fresh_copy",
    "load_tensormap",
    "module_to_tensormap",
    "shared_head",
]

C = TypeVar("C", bound=TrainConfig)


def fresh_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` on the CPU with every submodule's parameters re-initialised by its
    own ``reset_parameters`` (random: the caller seeds the CPU generator). On the CPU because a
    copy re-initialised on a GPU draws from CUDA's generator: a GPU agent would start from other
    weights than a CPU agent with the same seed, and the fleet's shared start would not be."""
    fresh = copy.deepcopy(module).cpu()
    for sub in fresh.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
    return fresh


def shared_head(head: nn.Module, role: str) -> SharedModule:
    """``head`` as a module every agent starts from identically: seeded by ``role`` and its
    tensor shapes (:func:`models.seeding.head_seed`), so alike across architectures."""
    seed = head_seed(role, {k: v.shape for k, v in head.state_dict().items()})
    return SharedModule(head, lambda: fresh_copy(head), seed)


class WeightExchangeEdge(EdgeAlgorithm[C]):
    """Receives and uploads one module's weights as the ``weights`` payload, and starts that
    module from weights shared by every agent of the architecture."""

    TASK_PAYLOADS: ClassVar[TaskPayloads] = task_payloads({"weights": TensorMap})

    def exchanged_module(self) -> nn.Module:
        """The module whose weights travel (default: the whole model)."""
        return self.ctx.model

    def weight_encoding(self) -> Encoding:
        """How uploaded weights are encoded (default: exact float32)."""
        return "raw"

    def shared_modules(self) -> dict[str, SharedModule]:
        """The model starts identical on every agent of its architecture (not per client)."""
        return {"model": self.shared_model(SHARED_MODEL_SEED)}

    def receive(self, payloads: dict[str, Payload]) -> None:
        """Overwrite the exchanged module with the global weights when the task carries them."""
        weights = received(payloads, "weights", TensorMap)
        if weights is None:
            return
        load_tensormap(self.exchanged_module(), weights, "payloads.weights")

    def reply_payloads(self) -> dict[str, Payload]:
        """The exchanged module's state dict."""
        return {"weights": module_to_tensormap(self.exchanged_module(), self.weight_encoding())}
