"""The edge half of an algorithm: hooks into the one training loop, registered by name.

An :class:`EdgeAlgorithm` answers tasks by phase. The base class implements the phases every
algorithm shares (``train``: receive knowledge, run the loop, reply with knowledge; ``final``:
nothing to learn, just evaluate) and leaves the algorithm to fill small hooks:
``receive`` (payloads from the coordinator), ``step_loss`` and ``after_step`` (the loop),
``reply_payloads`` (knowledge to upload), ``scores`` (how the model predicts), and
``extra_state`` / ``load_extra_state`` (what must survive a restart besides the model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edge_agent.trainer import (
    TensorData,
    TrainStats,
    make_optimizer,
    train_epochs,
)
from models import Classifier
from models.checkpoint import HeadSpec
from protocol.algorithms import TrainConfig, config_type
from protocol.errors import ConfigError, ProtocolError
from protocol.messages import Task
from protocol.payloads import Payload

__all__ = [
    "EDGE_ALGORITHMS",
    "EdgeAlgorithm",
    "EdgeContext",
    "PhaseResult",
    "create_edge_algorithm",
    "register_edge_algorithm",
]

C = TypeVar("C", bound=TrainConfig)
ProgressFn = Callable[[int, int, float], None]


@dataclass
class EdgeContext:
    """Everything the device holds: its model, its private data, where it computes."""

    model: Classifier
    train: TensorData
    test: TensorData
    num_classes: int
    device: torch.device
    generator: torch.Generator
    global_test: TensorData | None = None
    on_progress: ProgressFn | None = None

    @property
    def class_counts(self) -> list[int]:
        """Training samples per class."""
        return torch.bincount(self.train.y.cpu(), minlength=self.num_classes).tolist()


@dataclass
class PhaseResult:
    """What a phase produced: payloads to upload and metrics to report."""

    payloads: dict[str, Payload] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    num_samples: int = 0


class EdgeAlgorithm(Generic[C]):
    """Base of every edge algorithm; plain cross-entropy training with no exchange."""

    name: ClassVar[str] = ""

    def __init__(self, ctx: EdgeContext) -> None:
        self.ctx = ctx
        self.cfg: C | None = None

    # ----- phase dispatch -------------------------------------------------------------------
    def phases(self) -> dict[str, Callable[[Task], PhaseResult]]:
        """Phase name -> handler. Algorithms add phases (e.g. FedVTC's ``finetune``)."""
        return {"train": self.train_phase, "final": self.final_phase}

    def handle(self, task: Task) -> PhaseResult:
        """Run the handler of ``task.phase`` with the task's typed config."""
        handler = self.phases().get(task.phase)
        if handler is None:
            raise ProtocolError(
                f"task {task.task_id}: phase {task.phase!r} unknown to {self.name}; "
                f"known: {sorted(self.phases())}"
            )
        self.cfg = self.parse_config(task)
        return handler(task)

    def parse_config(self, task: Task) -> C:
        """The task's config as this algorithm's typed dataclass."""
        if task.algorithm != self.name:
            raise ConfigError(
                f"task {task.task_id} is for {task.algorithm!r}, agent runs {self.name!r}"
            )
        cfg = config_type(self.name).from_dict(
            dict(task.config), where=f"task {task.task_id}.config"
        )
        return cfg  # type: ignore[return-value]

    @property
    def config(self) -> C:
        """The config of the task being handled."""
        if self.cfg is None:
            raise ConfigError(f"{self.name}: no task config received yet")
        return self.cfg

    # ----- shared phases --------------------------------------------------------------------
    def train_phase(self, task: Task) -> PhaseResult:
        """Receive knowledge, train locally with the one loop, reply with knowledge."""
        self.receive(task.payloads)
        stats = self.local_train(self.ctx.train)
        payloads = self.reply_payloads()
        metrics = {
            "train_loss": stats.mean_loss,
            "train_s": stats.seconds,
            "samples_per_s": stats.samples_per_s,
        }
        return PhaseResult(payloads, metrics, len(self.ctx.train))

    def final_phase(self, task: Task) -> PhaseResult:
        """Receive the last knowledge (no training); the agent evaluates and exports."""
        self.receive(task.payloads)
        return PhaseResult(num_samples=len(self.ctx.train))

    def local_train(
        self, data: TensorData, epochs: int | None = None, params: list[nn.Parameter] | None = None
    ) -> TrainStats:
        """The one training loop over ``data`` with this algorithm's hooks."""
        params = list(self.ctx.model.parameters()) if params is None else params
        optimizer = make_optimizer(params, self.config)
        return train_epochs(
            self.ctx.model,
            data,
            self.config,
            self,
            optimizer=optimizer,
            epochs=epochs,
            generator=self.ctx.generator,
            on_progress=self.ctx.on_progress,
        )

    # ----- hooks ----------------------------------------------------------------------------
    def receive(self, payloads: dict[str, Payload]) -> None:
        """Take the coordinator's knowledge (default: none expected)."""

    def step_loss(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> Tensor:
        """Cross-entropy; algorithms add their terms."""
        return F.cross_entropy(logits, y)

    def after_step(self, x: Tensor, y: Tensor, features: Tensor) -> None:
        """Nothing by default."""

    def reply_payloads(self) -> dict[str, Payload]:
        """Knowledge to upload after training (default: none)."""
        return {}

    def scores(self, x: Tensor) -> Tensor:
        """Class scores used for evaluation and exported as the inference head."""
        out: Tensor = self.ctx.model(x)
        return out

    def head_spec(self) -> HeadSpec:
        """The inference head an exported model must carry."""
        return HeadSpec(type="logits", prototypes=None, valid=None)

    def extra_state(self) -> dict[str, Tensor]:
        """Algorithm state to checkpoint besides the model (tensors only)."""
        return {}

    def load_extra_state(self, state: dict[str, Tensor]) -> None:
        """Restore what :meth:`extra_state` saved."""


EDGE_ALGORITHMS: dict[str, type[EdgeAlgorithm[Any]]] = {}
A = TypeVar("A", bound=type[EdgeAlgorithm[Any]])


def register_edge_algorithm(name: str) -> Callable[[A], A]:
    """Class decorator registering the edge half of algorithm ``name``."""

    def deco(cls: A) -> A:
        if name in EDGE_ALGORITHMS:
            raise ValueError(f"edge algorithm {name!r} registered twice")
        config_type(name)  # both halves must share a registered config
        cls.name = name
        EDGE_ALGORITHMS[name] = cls
        return cls

    return deco


def create_edge_algorithm(name: str, ctx: EdgeContext) -> EdgeAlgorithm[Any]:
    """Instantiate the edge half of ``name``."""
    try:
        cls = EDGE_ALGORITHMS[name]
    except KeyError:
        raise ConfigError(f"unknown algorithm {name!r}; known: {sorted(EDGE_ALGORITHMS)}") from None
    return cls(ctx)
