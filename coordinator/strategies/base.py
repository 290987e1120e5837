"""The server half of an algorithm: hooks the one round engine calls, registered by name.

The engine owns selection, dispatch, deadlines, quorum, persistence and metrics. A strategy
only says what each step is (:meth:`Strategy.plan`), which agents may join (:meth:`admit`),
what it does in each phase (:meth:`Strategy.phase_hooks`: what each selected agent receives,
whether a reply is acceptable, how replies become the new global state, what the server trains
after them, given a :class:`ServerContext`), and how its state is saved (:meth:`state_dict`).
The base dispatches :meth:`configure`, :meth:`validate`, :meth:`aggregate` and
:meth:`server_train` by the step's phase through that one table.

The seams were drawn against all five seed algorithms (see ``docs/howto/add-an-algorithm.md``).
"""

from __future__ import annotations

import functools
import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeVar

from coordinator.aggregation import MEAN, RobustRule, aggregate_maps
from protocol.algorithms import AlgorithmConfig, TrainConfig, config_type
from protocol.algorithms.base import AveragingConfig
from protocol.contract.arrays import Encoding
from protocol.contract.messages import Register, Reply
from protocol.contract.payloads import Payload, PrototypeSet, TensorMap
from protocol.contract.validate import MAX_ABS_FEATURE, MAX_ABS_WEIGHT, check_max_abs, float_arrays
from protocol.contract.wire import WireModel
from protocol.errors import AdmissionError, ConfigError, ValidationError

if TYPE_CHECKING:  # the coordinator never imports torch unless a strategy trains
    import torch

__all__ = [
    "STRATEGIES",
    "AgentInfo",
    "Aggregator",
    "Configurer",
    "PhaseHooks",
    "ServerContext",
    "ServerTrainer",
    "Step",
    "Strategy",
    "Validator",
    "admit_one_input",
    "check_mode",
    "create_strategy",
    "register_strategy",
]

C = TypeVar("C", bound=TrainConfig)
P = TypeVar("P", bound=WireModel)


@dataclass(frozen=True)
class AgentInfo:
    """What the coordinator knows about a registered agent (never its data)."""

    device_id: str
    register: Register

    # computed once per registration: every reply's checks ask for them
    @functools.cached_property
    def classes(self) -> list[int]:
        """Classes present in the agent's training data."""
        return self.register.present_classes()

    @functools.cached_property
    def num_samples(self) -> int:
        """Training samples the agent holds."""
        return self.register.total_samples()


@dataclass(frozen=True)
class Step:
    """One unit of the run plan: a training round or a phase after the rounds."""

    round: int
    phase: str
    participation: Literal["sample", "all"] = "sample"


@functools.cache
def resolve_device(setting: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; other settings as given."""
    if setting != "auto":
        return setting
    import torch  # lazy: only a strategy that trains on the server pays for it

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class ServerContext:
    """What :meth:`Strategy.server_train` may use for step ``step_index``.

    ``seed`` depends only on the run's seed and the step's index, never on the attempt or the
    wall clock, so a step replayed after a restart trains the server exactly as before.
    """

    server_device: str  # the run's setting: auto, cpu, cuda or cuda:N
    seed: int
    step_index: int

    @classmethod
    def for_step(cls, run_seed: int, step_index: int, server_device: str = "auto") -> ServerContext:
        """The context of step ``step_index`` of a run seeded with ``run_seed``."""
        seed = random.Random(f"{run_seed}:server:{step_index}").getrandbits(63)
        return cls(server_device, seed, step_index)

    @property
    def device(self) -> str:
        """The torch device to train on (``auto`` resolved on first use)."""
        return resolve_device(self.server_device)

    def torch_generator(self) -> torch.Generator:
        """A CPU generator seeded with :attr:`seed` (draw on it, not on torch's global RNG)."""
        import torch

        return torch.Generator(device="cpu").manual_seed(self.seed)


#: The payloads of one selected agent's task.
Configurer = Callable[[Step, AgentInfo], dict[str, Payload]]
#: Rejects a reply that cannot be aggregated (raises :class:`ValidationError`).
Validator = Callable[[Step, AgentInfo, Reply], None]
#: Folds one step's valid replies, ordered by device id, into the global state; returns metrics.
Aggregator = Callable[[Step, list[tuple[AgentInfo, Reply]]], dict[str, float]]
#: Server-side training after the step's aggregation; returns metrics.
ServerTrainer = Callable[[Step, ServerContext], dict[str, float]]


@dataclass(frozen=True)
class PhaseHooks:
    """What a strategy does in one phase; a hook left ``None`` does nothing there (no payloads,
    no checks beyond the engine's, nothing folded, nothing trained)."""

    configure: Configurer | None = None
    validate: Validator | None = None
    aggregate: Aggregator | None = None
    server_train: ServerTrainer | None = None


NO_HOOKS = PhaseHooks()


class Strategy(Generic[C]):
    """Base strategy: no knowledge exchanged; subclasses fill the hooks.

    Value bounds (``docs/concepts/security.md``): every float a reply carries is finite by
    construction
    of the payloads; :meth:`check_prototypes` and :meth:`check_values` also refuse magnitudes
    no honest model produces, so that one accepted reply cannot make the global state useless.
    """

    name: ClassVar[str] = ""
    #: Largest |value| accepted in prototypes, features, logits and SD vectors of a reply.
    max_abs_feature: ClassVar[float] = MAX_ABS_FEATURE
    #: Largest |value| accepted in model tensors (``TensorMap`` payloads) of a reply.
    max_abs_weight: ClassVar[float] = MAX_ABS_WEIGHT
    #: Phases whose replies count at most the agent's registered training samples. Every
    #: edge ``train`` phase reports ``len(train)`` or fewer (FedType: |D_i| without its
    #: calibration split); FedVTC's ``final`` counts synthetic samples, so it is not bounded.
    bounded_sample_phases: ClassVar[frozenset[str]] = frozenset({"train"})
    #: The algorithm averages whole models, so its fleet must run one architecture (``admit``
    #: refuses the others); tools that plan runs read it to leave mixed fleets out.
    one_architecture: ClassVar[bool] = False
    #: The strategy's :meth:`admit` refuses some agents. The engine calls ``admit`` only when
    #: this is set: its fleet list costs O(N) a registration, O(N^2) a fleet.
    admission_rules: ClassVar[bool] = False
    #: How the strategy takes a reply to a task of an older global version (``run.mode =
    #: "buffered"``, ``docs/howto/stragglers.md``): ``"weighted"``: its aggregation multiplies
    #: each reply's usual weight by :meth:`reply_weight`; ``""``: it cannot run buffered, and a
    #: buffered run is refused at start with :attr:`unbuffered_reason`.
    stale_replies: ClassVar[str] = ""
    unbuffered_reason: ClassVar[str] = "it declares no way to fold replies of older rounds"
    #: The strategy reads each agent's label histogram (``Register.class_counts``): the
    #: coordinator's state asks agents for it, and refuses one that registers only its class
    #: set. Without it agents disclose only which classes they hold and how many samples in
    #: all, and a registration's per-class counts are empty.
    needs_class_counts: ClassVar[bool] = False

    def __init__(self, config: C, *, num_classes: int, seed: int = 0) -> None:
        self.config = config
        self.num_classes = num_classes
        self.seed = seed
        # task id -> staleness weight of the replies being folded; set by the engine before
        # each aggregation in buffered mode (empty: every reply is fresh)
        self.staleness_weights: dict[str, float] = {}
        # the feature size most of the open step's participants registered (None: none told)
        self.fleet_feature_dim: int | None = None

    # ----- the plan -------------------------------------------------------------------------
    def plan(self, rounds: int) -> list[Step]:
        """Training rounds 1..rounds, then :meth:`final_steps`."""
        return [Step(r, "train") for r in range(1, rounds + 1)] + self.final_steps(rounds)

    def final_steps(self, rounds: int) -> list[Step]:
        """After the rounds: every agent evaluates and exports (``final``)."""
        return [Step(rounds + 1, "final", "all")]

    def select(self, step_index: int, step: Step, online: list[str], fraction: float) -> list[str]:
        """Seeded choice of participants among online agents (all for ``participation=all``)."""
        ids = sorted(online)
        if step.participation == "all" or fraction >= 1.0:
            return ids
        k = max(1, round(fraction * len(ids)))
        return sorted(random.Random(f"{self.seed}:{step_index}").sample(ids, k))

    # ----- hooks ----------------------------------------------------------------------------
    def declared_feature_dim(self) -> int:
        """The size of the agents' feature vectors this run declares (0: none): the config's
        :meth:`~protocol.algorithms.AlgorithmConfig.model_feature_dim`. An agent that registers
        another size is refused at registration; the coordinator's state announces it."""
        return self.config.model_feature_dim(self.num_classes)

    def admit(self, agent: AgentInfo, fleet: list[AgentInfo]) -> None:
        """Refuse an agent that cannot join the already-admitted ``fleet``.

        Raise :class:`~protocol.errors.AdmissionError` with a precise reason: the engine sends
        it to the agent, which stops. The engine has already checked the algorithm name and
        ``num_classes``; the default admits everyone else. A strategy overriding it sets
        :attr:`admission_rules`.
        """

    def phase_hooks(self) -> dict[str, PhaseHooks]:
        """Phase -> what this strategy does in it; a phase absent here does nothing but be
        scheduled (default: no phase does anything, as ``local``).

        The one table of per-phase behaviour: a multi-phase algorithm adds its phases here
        (FedVTC's ``upload_generator``) instead of branching on ``step.phase`` in a hook.
        """
        return {}

    def configure(self, step: Step, agent: AgentInfo) -> dict[str, Payload]:
        """Payloads for one selected agent: the phase's ``configure`` hook (default: none)."""
        hook = self.phase_hooks().get(step.phase, NO_HOOKS).configure
        return {} if hook is None else hook(step, agent)

    def validate(self, step: Step, agent: AgentInfo, reply: Reply) -> None:
        """Reject a reply that cannot be aggregated: the phase's ``validate`` hook.

        Runs after :meth:`check_values` (``ReplyDesk.check``): every float of the reply is
        already within its bound, so a hook checks structure and meaning, not magnitudes again.
        """
        hook = self.phase_hooks().get(step.phase, NO_HOOKS).validate
        if hook is not None:
            hook(step, agent, reply)

    def aggregate(self, step: Step, replies: list[tuple[AgentInfo, Reply]]) -> dict[str, float]:
        """Fold a step's valid replies into the global state with the phase's ``aggregate``
        hook; return scalar metrics (a phase without one folds nothing)."""
        hook = self.phase_hooks().get(step.phase, NO_HOOKS).aggregate
        return {} if hook is None else hook(step, replies)

    def server_train(self, step: Step, ctx: ServerContext) -> dict[str, float]:
        """Server-side training after aggregation (Velo's CVAE, FedKTL's F): the phase's
        ``server_train`` hook (default none).

        A hook trains on ``ctx.device`` and draws randomness from ``ctx.torch_generator()`` so
        that a resumed step replays the same training.
        """
        hook = self.phase_hooks().get(step.phase, NO_HOOKS).server_train
        if hook is None:
            return {}
        # imported here: the guard's package imports torch, which a strategy without server
        # training (and the CLI) never needs
        from models.trace_guard import TRACE_GUARD

        with TRACE_GUARD.running():  # a simulated agent's export may be tracing meanwhile
            return hook(step, ctx)

    def state_dict(self) -> dict[str, Payload]:
        """The global state to persist after each step."""
        return {}

    def load_state_dict(self, state: dict[str, Payload]) -> None:
        """Restore what :meth:`state_dict` produced."""

    # ----- shared aggregation helpers -------------------------------------------------------
    def reply_weight(self, reply: Reply) -> float:
        """The factor on ``reply``'s usual aggregation weight: its staleness weight in buffered
        mode (:mod:`coordinator.engine.staleness`), 1 for a fresh reply and in sync mode."""
        return self.staleness_weights.get(reply.task_id, 1.0)

    @property
    def robust(self) -> RobustRule:
        """How this run combines uploads: the config's ``aggregation``, ``trim_fraction`` and
        ``clip_norm`` (:class:`~protocol.algorithms.base.AveragingConfig`); the plain mean for
        algorithms that average nothing."""
        cfg = self.config
        if isinstance(cfg, AveragingConfig):
            return RobustRule(cfg.aggregation, cfg.trim_fraction, cfg.clip_norm)
        return MEAN

    def average(
        self,
        maps: Sequence[TensorMap],
        weights: Sequence[float] | None,
        encoding: Encoding,
        what: str,
    ) -> TensorMap:
        """The round's tensor maps combined under :attr:`robust` (default: the weighted mean,
        :func:`~coordinator.aggregation.weighted_mean` itself)."""
        return aggregate_maps(maps, weights, self.robust, encoding, what)

    # ----- shared validation helpers --------------------------------------------------------
    @staticmethod
    def payload(reply: Reply, key: str, kind: type[P]) -> P:
        """``reply.payloads[key]`` typed as ``kind``.

        The engine has checked keys and kinds against the algorithm's ``REPLY_PAYLOADS``, so
        this raises only for an optional payload that this configuration requires.
        """
        value = reply.payloads.get(key)
        if not isinstance(value, kind):
            got = "nothing" if value is None else type(value).KIND
            raise ValidationError(f"reply.payloads.{key}", f"a {kind.KIND} payload", got)
        return value

    def check_prototypes(
        self, agent: AgentInfo, reply: Reply, key: str, dim: int | None
    ) -> PrototypeSet:
        """A reply's prototype payload, checked against the federation and the agent's classes
        (its values were bounded by :meth:`check_values` before :meth:`validate`)."""
        protos = reply.payloads.get(key)
        if not isinstance(protos, PrototypeSet):
            got = "nothing" if protos is None else type(protos).KIND
            raise ValidationError(f"reply.payloads.{key}", "a prototype set", got)
        ids = protos.class_ids.tolist()
        if ids and max(ids) >= self.num_classes:
            raise ValidationError(
                f"reply.payloads.{key}.class_ids", f"ids < {self.num_classes}", ids
            )
        unknown = sorted(set(ids) - set(agent.classes))
        if unknown:
            raise ValidationError(
                f"reply.payloads.{key}.class_ids",
                f"classes the agent registered {agent.classes}",
                unknown,
            )
        if dim is not None and protos.class_ids.size and protos.dim != dim:
            raise ValidationError(f"reply.payloads.{key}.vectors", f"dimension {dim}", protos.dim)
        return protos

    def check_values(self, reply: Reply) -> None:
        """Refuse any float of any payload beyond the bounds: ``max_abs_weight`` for model
        tensors, ``max_abs_feature`` for everything else (features, logits, images)."""
        for key, payload in reply.payloads.items():
            bound = self.max_abs_weight if isinstance(payload, TensorMap) else self.max_abs_feature
            for field, arr in float_arrays(payload, f"reply.payloads.{key}"):
                check_max_abs(arr, bound, field)

    def check_num_samples(self, step: Step, agent: AgentInfo, reply: Reply) -> None:
        """Refuse a ``bounded_sample_phases`` reply counting more samples than its agent
        registered: ``num_samples`` weighs sample-weighted means (:meth:`average`), so an
        unbounded claim would hand one reply nearly all of a round's weight."""
        registered = agent.num_samples
        if step.phase in self.bounded_sample_phases and reply.num_samples > registered:
            raise ValidationError(
                "reply.num_samples",
                f"<= {registered} registered training samples",
                reply.num_samples,
            )

    def observe_fleet(self, agents: Iterable[AgentInfo]) -> None:
        """The engine calls this when a step opens, with its participants' registrations:
        :meth:`expected_dim` falls back on the feature size most of them registered
        (``Register.feature_dim``; ties: the smaller size), never on a reply, so that no
        single frame can choose the size every other reply must have."""
        sizes = Counter(a.register.feature_dim for a in agents if a.register.feature_dim > 0)
        best = max(sizes.items(), key=lambda kv: (kv[1], -kv[0]), default=None)
        self.fleet_feature_dim = None if best is None else best[0]

    def expected_dim(self, current: int | None = None, declared: int = 0) -> int | None:
        """The feature dimension a reply's vectors must have: ``declared`` (the config's
        ``feature_dim``) when the run declares one; else ``current``, the global state's,
        once it holds vectors; else the fleet's registered size (:meth:`observe_fleet`).
        ``None``: nothing is known (no participant told its size), anything goes."""
        if declared > 0:
            return declared
        if current is not None:
            return current
        return self.fleet_feature_dim

    @staticmethod
    def held_dim(protos: PrototypeSet | None) -> int | None:
        """The dimension of the prototypes a global state holds (``None``: none yet)."""
        return protos.dim if protos is not None and protos.class_ids.size else None


def admit_one_input(agent: AgentInfo, fleet: list[AgentInfo], shared_model: str) -> None:
    """Refuse an agent whose input differs from the fleet's: the shared model takes one input."""
    others = [a.register for a in fleet if a.device_id != agent.device_id]
    mine = agent.register.input_spec
    if others and mine != others[0].input_spec:
        theirs = others[0].input_spec
        raise AdmissionError(
            agent.device_id,
            f"the fleet shares one {shared_model} built for input "
            f"{theirs.channels}x{theirs.height}x{theirs.width}; this agent feeds "
            f"{mine.channels}x{mine.height}x{mine.width}",
        )


STRATEGIES: dict[str, type[Strategy[Any]]] = {}
S = TypeVar("S", bound=type[Strategy[Any]])


def register_strategy(name: str) -> Callable[[S], S]:
    """Class decorator registering the server half of algorithm ``name``."""

    def deco(cls: S) -> S:
        if name in STRATEGIES:
            raise ValueError(f"strategy {name!r} registered twice")
        config_type(name)  # both halves share one registered config
        cls.name = name
        STRATEGIES[name] = cls
        return cls

    return deco


def create_strategy(
    name: str, config: AlgorithmConfig, *, num_classes: int, seed: int = 0
) -> Strategy[Any]:
    """Instantiate the server half of ``name``."""
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ConfigError(f"unknown algorithm {name!r}; known: {sorted(STRATEGIES)}") from None
    return cls(config, num_classes=num_classes, seed=seed)


def check_mode(name: str, mode: str) -> None:
    """Refuse, with the reason, ``run.mode = buffered`` for an algorithm whose server half
    cannot fold replies of older rounds (an unknown ``name`` is left to its config's check)."""
    cls = STRATEGIES.get(name)
    if mode == "buffered" and cls is not None and not cls.stale_replies:
        raise ConfigError(
            f"run.mode = buffered: {name} cannot run buffered: {cls.unbuffered_reason}; "
            "run it with run.mode = sync"
        )
