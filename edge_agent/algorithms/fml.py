"""FML, edge half: the private model and the shared meme co-train by deep mutual learning in
the one loop; only the meme travels.

Both models are parameter groups of the main step on one summed loss. Each model's KL term
treats the other's prediction as a constant target (the teacher's logits are detached), so the
gradient of the sum w.r.t. each model is the gradient of its own loss and each group's own
optimiser steps it, as two optimisers on two losses would. :class:`SharedModelEdge` holds what
FML and FedKD share: the meme built from the task's ``shared_model`` with one fleet-wide seed,
exchanged, checkpointed and evaluated.
"""

from __future__ import annotations

from typing import TypeVar

import torch.nn.functional as F
from torch import Tensor, nn

from edge_agent.algorithms.base import (
    EdgeContext,
    PhaseResult,
    SharedModule,
    register_edge_algorithm,
)
from edge_agent.algorithms.fedtype import forward_kd
from edge_agent.algorithms.weights import SHARED_MODEL_SEED, WeightExchangeEdge
from edge_agent.seeding import derived_seed, seeded
from edge_agent.trainer import ParamGroup, TensorData, TrainStats, evaluate
from models import Classifier, create_model
from models.checkpoint import ModelSpec
from protocol.algorithms.fml import FMLConfig, SharedModelConfig
from protocol.contract.arrays import Encoding
from protocol.contract.messages import Task

__all__ = ["FMLEdge", "SharedModelEdge", "mutual_kl"]

C = TypeVar("C", bound=SharedModelConfig)

_SHARED = "shared."  # prefix of the meme's tensors in the checkpoint's extra state


def mutual_kl(student: Tensor, teacher: Tensor, reduction: str = "batchmean") -> Tensor:
    """``KL(softmax teacher || softmax student)`` with the teacher detached: per sample
    (``batchmean``) or also divided by the number of classes (``elementwise_mean``)."""
    kl = forward_kd(student, teacher)
    return kl / student.shape[1] if reduction == "elementwise_mean" else kl


class SharedModelEdge(WeightExchangeEdge[C]):
    """A private model (``ctx.model``, never sent) and a shared model (``self.shared``, the
    ``weights``), built at the first task from its ``shared_model`` and the agent's input."""

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        self.shared: Classifier | None = None
        self._restored: dict[str, Tensor] | None = None
        self._metrics: dict[str, float] = {}

    def shared_net(self) -> Classifier:
        """The shared model (built, seeded fleet-wide, on first use)."""
        if self.shared is None:
            with seeded(self._shared_seed()):
                self.shared = self._build_shared().to(self.ctx.device)
            restored = self._restored
            if restored is not None and _fits(self.shared, restored):
                self.shared.load_state_dict(restored)
        return self.shared

    def _build_shared(self) -> Classifier:
        spec = ModelSpec.from_model(self.ctx.model)
        return create_model(
            self.config.shared_model,
            num_classes=self.ctx.num_classes,
            in_chans=spec.in_chans,
            input_size=spec.input_size,
        )

    def _shared_seed(self) -> int:
        spec = ModelSpec.from_model(self.ctx.model)
        h, w = spec.input_size
        key = f"{self.name}-shared|{self.config.shared_model}|{spec.in_chans}x{h}x{w}"
        return derived_seed(SHARED_MODEL_SEED, key)

    def exchanged_module(self) -> nn.Module:
        """The shared model travels; the private model never does."""
        return self.shared_net()

    def weight_encoding(self) -> Encoding:
        """As the run configures (``weight_encoding``)."""
        return self.config.weight_encoding

    def shared_modules(self) -> dict[str, SharedModule]:
        """Only the shared model starts identical fleet-wide."""
        shared = self.shared_net()
        return {"shared": SharedModule(shared, self._build_shared, self._shared_seed())}

    def param_groups(self) -> list[ParamGroup]:
        """Both models on the main step, each with its own optimiser and clipping."""
        lr = self.config.shared_lr or None
        return [
            ParamGroup("private", self.ctx.model),
            ParamGroup("shared", self.shared_net(), lr=lr),
        ]

    def train_phase(self, task: Task) -> PhaseResult:
        """One participation; reports the shared model's test accuracy as received
        (``global_shared_acc``) and as trained (``shared_acc``)."""
        self._metrics = {}
        result = super().train_phase(task)
        result.metrics.update(self._metrics)
        return result

    def local_train(self, data: TensorData, epochs: int | None = None) -> TrainStats:
        """The one loop, between two evaluations of the shared model."""
        shared = self.shared_net()
        before = _accuracy(shared, self.ctx.test)
        stats = super().local_train(data, epochs)
        after = _accuracy(shared, self.ctx.test)
        if before is not None and after is not None:
            self._metrics = {"global_shared_acc": before, "shared_acc": after}
        return stats

    def extra_state(self) -> dict[str, Tensor]:
        """The local copy of the shared model survives restarts."""
        if self.shared is None:
            return {}
        return {_SHARED + k: v.detach().cpu() for k, v in self.shared.state_dict().items()}

    def load_extra_state(self, state: dict[str, Tensor]) -> None:
        """Keep the shared model's tensors until the first task says what to build."""
        super().load_extra_state(state)
        shared = {k[len(_SHARED) :]: v for k, v in state.items() if k.startswith(_SHARED)}
        self._restored = shared or None
        if not shared:  # nothing to resume from: the shared model still needs its init
            self._shared_ready = False


def _fits(module: nn.Module, state: dict[str, Tensor]) -> bool:
    own = module.state_dict()
    return set(state) == set(own) and all(state[k].shape == own[k].shape for k in own)


def _accuracy(model: nn.Module, data: TensorData) -> float | None:
    return evaluate(model, data).accuracy if len(data) else None


@register_edge_algorithm("fml")
class FMLEdge(SharedModelEdge[FMLConfig]):
    """Deep mutual learning between the private model and the meme."""

    def step_loss(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> Tensor:
        """``L_private + L_meme`` (see the module doc); teachers detached."""
        cfg = self.config
        zm = self.shared_net()(x)
        private = cfg.alpha * F.cross_entropy(logits, y) + (1 - cfg.alpha) * mutual_kl(
            logits, zm, cfg.kl_reduction
        )
        meme = cfg.beta * F.cross_entropy(zm, y) + (1 - cfg.beta) * mutual_kl(
            zm, logits, cfg.kl_reduction
        )
        return private + meme
