"""A second model every agent builds from the task's config and its own input, seeded fleet-wide
(FML's meme, FedKD's mentee, FedType's proxy): the build-and-seed recipe, and the edge half of
the algorithms that exchange such a shared model next to a private one."""

from __future__ import annotations

from typing import TypeVar

from torch import Tensor, nn

from edge_agent.algorithms.base import EdgeContext, PhaseResult, SharedModule
from edge_agent.algorithms.weights import SHARED_MODEL_SEED, WeightExchangeEdge
from edge_agent.trainer import ParamGroup, TensorData, TrainStats, evaluate
from models import Classifier, create_model
from models.checkpoint import ModelSpec
from models.seeding import derived_seed, seeded
from protocol.algorithms.fml import CLIENT0_ARCH, SharedModelConfig
from protocol.contract.arrays import Encoding
from protocol.contract.messages import Task
from protocol.errors import ConfigError

__all__ = ["SharedModelEdge", "build_fleet_model", "fleet_model_seed", "seeded_fleet_model"]

C = TypeVar("C", bound=SharedModelConfig)

_SHARED = "shared."  # prefix of the meme's tensors in the checkpoint's extra state


def build_fleet_model(ctx: EdgeContext, arch: str) -> Classifier:
    """A fresh ``arch`` for the federation's classes and this agent's input (random: the
    caller seeds)."""
    spec = ModelSpec.from_model(ctx.model)
    return create_model(
        arch, num_classes=ctx.num_classes, in_chans=spec.in_chans, input_size=spec.input_size
    )


def fleet_model_seed(ctx: EdgeContext, role: str, arch: str) -> int:
    """The seed of the ``role`` model ``arch``: the same on every agent feeding it one input."""
    spec = ModelSpec.from_model(ctx.model)
    h, w = spec.input_size
    return derived_seed(SHARED_MODEL_SEED, f"{role}|{arch}|{spec.in_chans}x{h}x{w}")


def seeded_fleet_model(ctx: EdgeContext, role: str, arch: str) -> Classifier:
    """:func:`build_fleet_model` under :func:`fleet_model_seed`, on the agent's device: the
    fleet's shared start."""
    with seeded(fleet_model_seed(ctx, role, arch)):
        return build_fleet_model(ctx, arch).to(ctx.device)


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
            if self.config.shared_model == CLIENT0_ARCH:
                raise ConfigError(
                    f"shared_model = {CLIENT0_ARCH!r} reached the agent: the coordinator "
                    "names the first agent's architecture in every task"
                )
            self.shared = seeded_fleet_model(self.ctx, self._role(), self.config.shared_model)
            restored = self._restored
            if restored is not None and _fits(self.shared, restored):
                self.shared.load_state_dict(restored)
        return self.shared

    def _role(self) -> str:
        return f"{self.name}-shared"

    def _build_shared(self) -> Classifier:
        return build_fleet_model(self.ctx, self.config.shared_model)

    def exchanged_module(self) -> nn.Module:
        """The shared model travels; the private model never does."""
        return self.shared_net()

    def weight_encoding(self) -> Encoding:
        """As the run configures (``weight_encoding``)."""
        return self.config.weight_encoding

    def shared_modules(self) -> dict[str, SharedModule]:
        """Only the shared model starts identical fleet-wide."""
        shared = self.shared_net()
        seed = fleet_model_seed(self.ctx, self._role(), self.config.shared_model)
        return {"shared": SharedModule(shared, self._build_shared, seed)}

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
