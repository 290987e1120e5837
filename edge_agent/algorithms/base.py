"""The edge half of an algorithm: hooks into the one training loop, registered by name.

An :class:`EdgeAlgorithm` answers tasks by phase. The base class implements the phases every
algorithm shares (``train``: receive knowledge, run the loop, reply with knowledge; ``final``:
nothing to learn, just evaluate) and leaves the algorithm to fill small hooks:
``receive`` (payloads from the coordinator), ``param_groups``, ``step_loss`` and ``after_step``
(what the loop trains and on which loss), ``shared_modules`` (what every agent must start from
identically), ``reply_payloads`` (knowledge to upload), ``scores`` (how the model predicts), and
``extra_state`` / ``load_extra_state`` and ``random_streams`` (what must survive a restart
besides the model).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from edge_agent.class_stats import ClassMeans

from edge_agent.dp import DpSettings, PrivacyLedger, privatize, public_bounds
from edge_agent.dp_sgd import DpSgd, per_sample_modules
from edge_agent.trainer import ParamGroup, TensorData, TrainStats, train_epochs
from models import Classifier
from models.checkpoint import Checkpoint, HeadSpec, ModelSpec
from models.seeding import SHARED_MODEL_SEED, derived_seed, seeded
from protocol.algorithms import TrainConfig, config_type
from protocol.contract.messages import Task
from protocol.contract.payloads import Payload
from protocol.errors import ConfigError, ProtocolError, ValidationError

__all__ = [
    "EDGE_ALGORITHMS",
    "RNG_PREFIX",
    "EdgeAlgorithm",
    "EdgeContext",
    "PhaseResult",
    "SharedModule",
    "TaskPayloads",
    "create_edge_algorithm",
    "received",
    "register_edge_algorithm",
    "task_payloads",
]

#: The checkpoint-extra key prefix of a random stream's state
#: (:meth:`EdgeAlgorithm.checkpoint_state`).
RNG_PREFIX = "rng."

C = TypeVar("C", bound=TrainConfig)
P = TypeVar("P", bound=Payload)
ProgressFn = Callable[[int, int, float], None]
#: Phase -> payload key -> the kind a task of that phase carries under it.
TaskPayloads = dict[str, dict[str, type[Payload]]]


def task_payloads(
    kinds: dict[str, type[Payload]],
    phases: tuple[str, ...] = ("train", "final"),
    inherited: TaskPayloads | None = None,
) -> TaskPayloads:
    """``kinds`` declared for each of ``phases``, added to the ``inherited`` declaration."""
    out = {phase: dict(declared) for phase, declared in (inherited or {}).items()}
    for phase in phases:
        out.setdefault(phase, {}).update(kinds)
    return out


def received(payloads: dict[str, Payload], key: str, kind: type[P]) -> P | None:
    """``payloads[key]`` typed as ``kind``, or None when the task does not carry it (the kinds
    were checked against ``TASK_PAYLOADS`` by :meth:`EdgeAlgorithm.handle`)."""
    value = payloads.get(key)
    if value is not None and not isinstance(value, kind):
        raise ValidationError(f"payloads.{key}", kind.KIND, value.KIND)
    return value


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
    # held out of the training data when the run asks for it (hyper.validation_fraction): the
    # agent reports acc_val on it and keeps its best round by it; nothing trains on it
    validation: TensorData | None = None
    on_progress: ProgressFn | None = None
    # a fresh model of the same architecture (the factory's create_model call), so that an
    # algorithm can re-initialise the model from a seed shared by the fleet
    model_builder: Callable[[], Classifier] | None = None
    # the agent's stop request (its run loop sets it here): the training loop checks it every
    # batch, so a SIGTERM ends a task of 1,000 epochs within one batch
    stop: threading.Event | None = None
    # the device's privacy accountant (hyper.dp); the agent's is kept in its state directory
    privacy: PrivacyLedger = field(default_factory=PrivacyLedger)

    @property
    def class_counts(self) -> list[int]:
        """Training samples per class."""
        return torch.bincount(self.train.y.cpu(), minlength=self.num_classes).tolist()

    def build_model(self) -> Classifier:
        """A freshly initialised model like :attr:`model` (random unless the caller seeds)."""
        if self.model_builder is None:
            raise ConfigError("EdgeContext.model_builder is not set: the model cannot be rebuilt")
        return self.model_builder()


@dataclass(frozen=True)
class SharedModule:
    """A module every agent starts from identically: its weights become ``build()``'s, built
    under :func:`models.seeding.seeded` with ``seed``, which all agents must agree on."""

    module: nn.Module
    build: Callable[[], nn.Module]
    seed: int


@dataclass
class PhaseResult:
    """What a phase produced: payloads to upload and metrics to report."""

    payloads: dict[str, Payload] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    num_samples: int = 0


class EdgeAlgorithm(Generic[C]):
    """Base of every edge algorithm; plain cross-entropy training with no exchange."""

    name: ClassVar[str] = ""
    # False: the model itself is private (FedType's private model): the agent registers
    # neither its architecture nor its size, only what the algorithm exchanges travels
    discloses_model: ClassVar[bool] = True
    #: What each phase's task may carry, by key and kind (each optional: the server sends
    #: nothing before it has something); :meth:`handle` checks a task against it once.
    TASK_PAYLOADS: ClassVar[TaskPayloads] = {}
    #: The per-class sums one training reply releases through :meth:`release` (hyper.dp).
    DP_SUMS: ClassVar[int] = 1
    #: The phase whose reply releases the per-class sums (CCVR: its ``upload_stats``).
    DP_RELEASE_PHASE: ClassVar[str] = "train"

    def __init__(self, ctx: EdgeContext) -> None:
        self.ctx = ctx
        self.cfg: C | None = None
        self._shared_ready = False  # shared_init ran (or a checkpoint was restored)
        self._dp_metrics: dict[str, float] = {}  # the last release's epsilon figures
        self._dp_sgd: DpSgd | None = None  # the train phase's DP-SGD (hyper.dp, DP_SGD)

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
        self.check_task_payloads(task)
        return handler(task)

    def check_task_payloads(self, task: Task) -> None:
        """Refuse a task carrying a declared payload of another kind (:attr:`TASK_PAYLOADS`)."""
        declared = self.TASK_PAYLOADS.get(task.phase, {})
        for key, value in task.payloads.items():
            kind = declared.get(key)
            if kind is not None and not isinstance(value, kind):
                raise ValidationError(f"payloads.{key}", kind.KIND, value.KIND)

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

    # ----- differential privacy (edge_agent.dp) ---------------------------------------------
    def dp_clip(self) -> float:
        """The L2 bound of each vector added to a released class sum (0: DP off, no clip)."""
        settings = DpSettings.of(self.config)
        return 0.0 if settings is None else settings.clip

    def release(self, stats: Sequence[ClassMeans], contributions: int) -> None:
        """Make per-class sums ``stats`` private before they leave (nothing when DP is off):
        each sample was added at most ``contributions`` times (local epochs, or 1)."""
        settings = DpSettings.of(self.config)
        if settings is not None:
            # the released counts are capped by what the coordinator already knows: the
            # histogram registered noised, else the class set and total a count-less
            # registration sends; a cap at the true counts would leak them (the largest
            # count a run releases would be the true one)
            registered = self.ctx.privacy.registered
            held = public_bounds(self.ctx.class_counts) if registered is None else registered
            self._dp_metrics = privatize(stats, held, contributions, settings, self.ctx.privacy)

    def spend_dp_sgd(self, settings: DpSettings) -> None:
        """Plan this round's DP-SGD and account its steps before they run (the weights that
        leave are trained by them, so the round's spend is certain once it trains).

        Raises:
            ConfigError: a trained module has no per-sample gradients (BatchNorm).
            PrivacyBudgetError: the round would exceed the budget.
        """
        per_sample_modules([g.module for g in self.param_groups() if g.loss is None])
        cfg, ledger = self.config, self.ctx.privacy
        # where the device releases per-class sums too, the steps are calibrated on their
        # composition with every sum the run plans (one ledger, one budget), and a round whose
        # reply releases sums checks both before it trains
        per_release = self.DP_SUMS + 1
        planned = settings.planned_statistics(per_release, ledger.extra_mechanisms)
        plan = DpSgd.plan(settings, len(self.ctx.train), cfg.batch_size, cfg.local_epochs, planned)
        now = planned is not None and self.DP_RELEASE_PHASE == "train"
        this_round = (planned[0], per_release, 1.0) if planned is not None and now else None
        self._dp_metrics = plan.spend(settings, ledger, cfg.local_epochs, this_round)
        self._dp_sgd = plan

    # ----- shared phases --------------------------------------------------------------------
    def train_phase(self, task: Task) -> PhaseResult:
        """Receive knowledge, train locally with the one loop, reply with knowledge."""
        settings = DpSettings.of(self.config)
        dp_sgd = settings is not None and self.config.dp_sgd_trains()
        if settings is not None and not dp_sgd:  # a spent budget: the device does not train
            self.ctx.privacy.check(settings, self.DP_SUMS + 1)
        self._dp_metrics = {}
        spent = 0.0 if settings is None else self.ctx.privacy.epsilon(settings.delta)
        if self.needs_shared_init():  # before receive: received knowledge wins over the init
            self.shared_init()
            self._shared_ready = True
        self.receive(task.payloads)
        if settings is not None and dp_sgd:
            self.spend_dp_sgd(settings)
        try:
            stats = self.local_train(self.ctx.train)
        finally:
            self._dp_sgd = None
        payloads = self.reply_payloads()
        if settings is not None and not self._dp_metrics:
            # the config promised private statistics or weights: never send them plain
            raise RuntimeError(f"{self.name}: hyper.dp is on but no private release was made")
        if settings is not None:  # the round's steps and its release of sums, together
            now = self.ctx.privacy.epsilon(settings.delta)
            self._dp_metrics = {"dp_epsilon": now, "dp_epsilon_round": now - spent}
        metrics = {
            "train_loss": stats.mean_loss,
            "train_s": stats.seconds,
            "samples_per_s": stats.samples_per_s,
            **self._dp_metrics,
        }
        return PhaseResult(payloads, metrics, len(self.ctx.train))

    def final_phase(self, task: Task) -> PhaseResult:
        """Receive the last knowledge (no training); the agent evaluates and exports."""
        self.receive(task.payloads)
        return PhaseResult(num_samples=len(self.ctx.train))

    def local_train(self, data: TensorData, epochs: int | None = None) -> TrainStats:
        """The one training loop over ``data`` with this algorithm's hooks and groups."""
        return train_epochs(
            self.ctx.model,
            data,
            self.config,
            self,
            groups=self.param_groups(),
            epochs=epochs,
            generator=self.ctx.generator,
            on_progress=self.ctx.on_progress,
            on_epoch=self.before_epoch,
            stop=self.ctx.stop,
            dp_sgd=self._dp_sgd,
        )

    def before_epoch(self, epoch: int) -> None:
        """Work before local epoch ``epoch`` (0-based) of :meth:`local_train` (default: none)."""

    # ----- shared initial state -------------------------------------------------------------
    def shared_modules(self) -> dict[str, SharedModule]:
        """Modules every agent must start from identically, by name (default: none).

        Averaging weights is only meaningful between networks that started alike: an algorithm
        that averages a module declares it here (FedAvg: the model; FedVTC: the generator).
        """
        return {}

    def needs_shared_init(self) -> bool:
        """Whether :meth:`shared_init` runs before this round: once, before the first step."""
        return not self._shared_ready

    def start_modules(self) -> dict[str, SharedModule]:
        """:meth:`shared_modules`, led by the whole model at the first start when the run
        asks for one start per architecture (``arch_init``): the model first, so that a shared
        part of it (a head) is then overwritten by its own seed."""
        shared = self.shared_modules()
        arch_init = self.cfg is not None and self.cfg.arch_init  # a task config says so
        if arch_init and not self._shared_ready and "model" not in shared:
            return {"model": self.shared_model(SHARED_MODEL_SEED), **shared}
        return shared

    def shared_init(self) -> None:
        """Give each shared module the weights its seed alone determines."""
        for shared in self.start_modules().values():
            with seeded(shared.seed):  # exclusive among simulated agents; global RNG restored
                fresh = shared.build()
            shared.module.load_state_dict(fresh.state_dict())

    def shared_model(self, base_seed: int) -> SharedModule:
        """The whole model as a shared module, seeded by ``base_seed``, its architecture name
        and input spec: agents of one architecture agree, different architectures differ."""
        spec = ModelSpec.from_model(self.ctx.model)
        h, w = spec.input_size
        key = f"{spec.name}|{spec.in_chans}x{h}x{w}"
        return SharedModule(self.ctx.model, self.ctx.build_model, derived_seed(base_seed, key))

    # ----- hooks ----------------------------------------------------------------------------
    def receive(self, payloads: dict[str, Payload]) -> None:
        """Take the coordinator's knowledge (default: none expected)."""

    def param_groups(self) -> list[ParamGroup]:
        """What the loop trains: by default the whole model with the task config's settings.

        Add a group with its own ``loss`` for a second update per batch (FedVTC's generator).
        """
        return [ParamGroup("model", self.ctx.model)]

    def step_loss(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> Tensor:
        """Cross-entropy; algorithms add their terms."""
        return F.cross_entropy(logits, y)

    def after_step(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> None:
        """Nothing by default (e.g. statistics from the step's detached features and logits)."""

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

    def extra_exports(self) -> dict[str, Checkpoint]:
        """Models to export besides the agent's own, by name (each its own verified bundle)."""
        return {}

    def load_extra_state(self, state: dict[str, Tensor]) -> None:
        """Restore what :meth:`extra_state` saved; overrides call ``super()`` first.

        Called on every restore from a checkpoint: the restored weights are no longer a fresh
        start, so the shared initialisation must not overwrite them.
        """
        self._shared_ready = True

    def random_streams(self) -> dict[str, torch.Generator]:
        """The generators the device draws from across rounds, by name: the batch order, and an
        algorithm's own draws (overrides add theirs to ``super()``'s).

        A checkpoint keeps their states, so a restarted device continues each stream where it
        stopped instead of replaying it from its seed: a resumed run trains as one that never
        stopped (a benchmark interrupted mid-run resumes to the same curve).
        """
        return {"batch_order": self.ctx.generator}

    def checkpoint_state(self) -> dict[str, Tensor]:
        """What a checkpoint keeps besides the model: :meth:`extra_state` and the state of each
        of :meth:`random_streams`."""
        streams = {RNG_PREFIX + name: g.get_state() for name, g in self.random_streams().items()}
        return self.extra_state() | streams

    def restore_state(self, state: dict[str, Tensor]) -> None:
        """Restore what :meth:`checkpoint_state` saved. A stream the checkpoint lacks (one
        written before the stream existed) stays where its seed put it."""
        streams = self.random_streams()
        for key, value in state.items():
            name = key.removeprefix(RNG_PREFIX)
            if name != key and name in streams:
                streams[name].set_state(value)
        self.load_extra_state({k: v for k, v in state.items() if not k.startswith(RNG_PREFIX)})


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
