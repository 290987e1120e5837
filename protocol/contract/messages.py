"""One frozen dataclass per wire message (the body of an
:class:`~protocol.contract.codec.Envelope`).

``KIND`` is the message's tag on the wire and in topic names. Field validation lives in
``__post_init__``, so decoded and locally built messages are equally trustworthy.
See ``WIRE.md`` for the normative description of each message.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import msgpack

from protocol.contract.payloads import Payload, pack_payloads
from protocol.contract.wire import WireModel
from protocol.errors import ValidationError

__all__ = [
    "BUDGET_SPENT",
    "MESSAGE_TYPES",
    "RATE_LIMITED",
    "REFUSED",
    "STOPPED",
    "UNKNOWN_KNOWLEDGE",
    "Ack",
    "Capabilities",
    "Chunk",
    "ChunkRequest",
    "CoordinatorState",
    "ErrorReply",
    "Fetch",
    "InputSpec",
    "Knowledge",
    "Message",
    "Progress",
    "Register",
    "Reply",
    "RoundDescriptor",
    "Status",
    "Task",
    "payloads_digest",
    "task_inputs_digest",
]

Scalar = bool | int | float | str
MAX_NAME = 128


def _name(value: str, field_name: str) -> None:
    if not value or len(value) > MAX_NAME:
        raise ValidationError(field_name, f"1..{MAX_NAME} characters", value)


def _non_negative(value: int | float, field_name: str) -> None:
    if value < 0 or (isinstance(value, float) and not math.isfinite(value)):
        raise ValidationError(field_name, "a finite non-negative number", value)


def _check_class_names(names: list[str], num_classes: int) -> None:
    """Empty, or one unique name per class (the federation's meaning of each class index)."""
    if not names:
        return
    if len(names) != num_classes:
        raise ValidationError("class_names", f"{num_classes} names (one per class)", len(names))
    for i, name in enumerate(names):
        _name(name, f"class_names[{i}]")
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValidationError("class_names", "unique names", dup)


def _check_metrics(metrics: dict[str, float], field_name: str) -> None:
    for k, v in metrics.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ValidationError(f"{field_name}.{k}", "a finite number", v)


@dataclass(frozen=True, slots=True)
class InputSpec(WireModel):
    """What a device's model consumes: channels x height x width, values scaled to [0, 1]."""

    KIND: ClassVar[str] = "input_spec"
    channels: int
    height: int
    width: int

    def __post_init__(self) -> None:
        for n in ("channels", "height", "width"):
            if not 1 <= getattr(self, n) <= 65536:
                raise ValidationError(n, "an int in 1..65536", getattr(self, n))


@dataclass(frozen=True, slots=True)
class Capabilities(WireModel):
    """Compute a device offers: ``cpu`` or ``cuda``, accelerator name, memory in MiB, cores."""

    KIND: ClassVar[str] = "caps"
    device: str
    accelerator: str = ""
    memory_mb: int = 0
    cpu_count: int = 1


@dataclass(frozen=True, slots=True)
class Register(WireModel):
    """Agent -> coordinator, once per connection: who the device is and what data it holds."""

    KIND: ClassVar[str] = "register"
    device_id: str
    arch: str
    num_params: int
    capabilities: Capabilities
    input_spec: InputSpec
    num_classes: int
    # class id (decimal string) -> training samples of that class, when the run's algorithm
    # reads them (``CoordinatorState.class_counts``); else empty, and ``classes`` and
    # ``num_samples`` say only which classes the device holds and how many samples in all.
    # Keyword-only so that it may default: the wire order stays the declaration order.
    class_counts: dict[str, int] = field(default_factory=dict, kw_only=True)
    algorithm: str
    agent_version: str = ""
    # what each class index means, in order (empty: the dataset's numbering, unnamed)
    class_names: list[str] = field(default_factory=list)
    # random per agent process, renewed when a connection finds its broker session gone: a
    # register with the session the coordinator already knows is a repeat, not a restart, so
    # the task in flight is still queued for it and is not sent again (empty: unknown)
    session: str = ""
    # the model's feature vector size (prototypes, features), so a run that declares one can
    # refuse a device at registration instead of at its first reply (0: not disclosed)
    feature_dim: int = 0
    # the classes present in the training data, ascending, and its size: sent instead of
    # ``class_counts`` when the run does not need the label histogram (one form or the other)
    classes: list[int] = field(default_factory=list)
    num_samples: int = 0

    def __post_init__(self) -> None:
        _name(self.device_id, "device_id")
        _name(self.arch, "arch")
        _non_negative(self.num_params, "num_params")
        _non_negative(self.feature_dim, "feature_dim")
        if not 1 <= self.num_classes <= 100_000:
            raise ValidationError("num_classes", "an int in 1..100000", self.num_classes)
        for k, v in self.class_counts.items():
            if not k.isdigit() or int(k) >= self.num_classes:
                raise ValidationError("class_counts", f"class ids in 0..{self.num_classes - 1}", k)
            _non_negative(v, f"class_counts.{k}")
        self._check_class_set()
        _check_class_names(self.class_names, self.num_classes)
        if len(self.session) > MAX_NAME:
            raise ValidationError("session", f"0..{MAX_NAME} characters", self.session)

    def _check_class_set(self) -> None:
        """``classes`` and ``num_samples`` replace ``class_counts``: never both."""
        if self.class_counts and (self.classes or self.num_samples):
            raise ValidationError(
                "classes", "empty with class_counts (one form or the other)", self.classes
            )
        _non_negative(self.num_samples, "num_samples")
        ids = self.classes
        if any(not 0 <= c < self.num_classes for c in ids):
            raise ValidationError("classes", f"class ids in 0..{self.num_classes - 1}", ids)
        if any(a >= b for a, b in itertools.pairwise(ids)):
            raise ValidationError("classes", "ascending unique class ids", ids)
        if len(ids) > self.num_samples:
            raise ValidationError(
                "num_samples", f">= {len(ids)} (a sample a class)", self.num_samples
            )

    def counts_by_class(self) -> dict[int, int]:
        """Class counts keyed by integer class id (empty when only the class set was sent)."""
        return {int(k): v for k, v in self.class_counts.items()}

    @property
    def discloses_counts(self) -> bool:
        """Whether the registration carries the label histogram (``class_counts``)."""
        return bool(self.class_counts) or not (self.classes or self.num_samples)

    def present_classes(self) -> list[int]:
        """The classes present in the training data, ascending, in either form."""
        if self.classes:
            return list(self.classes)
        return sorted(c for c, n in self.counts_by_class().items() if n > 0)

    def total_samples(self) -> int:
        """The training samples the device holds, in either form."""
        return self.num_samples or sum(self.class_counts.values())


@dataclass(frozen=True, slots=True)
class Status(WireModel):
    """Retained birth / last-will message of an agent or of the coordinator."""

    KIND: ClassVar[str] = "status"
    state: Literal["online", "offline", "busy", "done"]
    detail: str = ""


@dataclass(frozen=True, slots=True)
class CoordinatorState(WireModel):
    """Retained coordinator state: run identity, algorithm and progress."""

    KIND: ClassVar[str] = "coord_state"
    state: Literal["starting", "running", "finished", "offline"]
    run_id: str
    algorithm: str
    round: int
    total_rounds: int
    # the federation's classes in order (empty: not declared); agents without their own
    # class list adopt it, and agents naming their classes otherwise are refused
    classes: list[str] = field(default_factory=list)
    # the feature size the run's algorithm requires of every model (0: none); an agent that
    # adopts the run builds its model with it, one of another size is refused at registration
    feature_dim: int = 0
    # whether the run's algorithm reads each device's label histogram: agents register their
    # ``class_counts`` only then, else only their class set and size (``Register.classes``)
    class_counts: bool = True
    # the run's hyper.dp budget where devices register their histogram (0: off): each then
    # sends it noised, as one more release charged to that budget (edge_agent.dp)
    dp_epsilon: float = 0.0
    dp_delta: float = 0.0
    dp_releases: int = 0

    def __post_init__(self) -> None:
        _check_class_names(self.classes, len(self.classes))
        _non_negative(self.feature_dim, "feature_dim")
        if not 0 <= self.dp_epsilon <= 1e3:
            raise ValidationError("dp_epsilon", "in [0, 1000] (0: off)", self.dp_epsilon)
        if self.dp_epsilon > 0 and not (0 < self.dp_delta < 1 and self.dp_releases >= 1):
            raise ValidationError(
                "dp_delta, dp_releases",
                "in (0, 1) and >= 1 with dp_epsilon",
                (self.dp_delta, self.dp_releases),
            )


@dataclass(frozen=True, slots=True)
class RoundDescriptor(WireModel):
    """Retained descriptor of the current step (round number, phase, deadline)."""

    KIND: ClassVar[str] = "round"
    run_id: str
    round: int
    phase: str
    deadline: float  # unix seconds
    selected: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Task(WireModel):
    """Coordinator -> agent: work for one round or phase.

    ``config`` is the algorithm's typed hyperparameters, flattened to scalars (see
    ``protocol.algorithms``); ``payloads`` carries the knowledge the algorithm sends down.
    """

    KIND: ClassVar[str] = "task"
    task_id: str
    run_id: str
    round: int
    phase: str
    deadline: float
    algorithm: str
    config: dict[str, Scalar] = field(default_factory=dict)
    payloads: dict[str, Payload] = field(default_factory=dict)
    # the digest of the round's `knowledge` whose payloads complete this task's (empty: none);
    # the agent runs the task with both maps merged (WIRE.md §5, broadcast)
    shared: bytes = b""

    def __post_init__(self) -> None:
        _name(self.task_id, "task_id")
        _name(self.phase, "phase")
        _non_negative(self.round, "round")
        _non_negative(self.deadline, "deadline")
        if self.shared and len(self.shared) != 32:
            raise ValidationError("shared", "empty or 32 bytes (SHA-256)", len(self.shared))


@dataclass(frozen=True, slots=True)
class Reply(WireModel):
    """Agent -> coordinator: the result of a task (payloads and metrics)."""

    KIND: ClassVar[str] = "reply"
    task_id: str
    round: int
    phase: str
    num_samples: int
    payloads: dict[str, Payload] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _name(self.task_id, "task_id")
        _non_negative(self.num_samples, "num_samples")
        _check_metrics(self.metrics, "metrics")


#: ``ErrorReply.code`` of the coordinator's answer to a registration it does not admit.
REFUSED = "refused"
#: ``ErrorReply.code`` of the coordinator's answer to a registration of a new device that came
#: past the run's registration rate: not admitted now; the device may register again later.
RATE_LIMITED = "rate_limited"
#: ``ErrorReply.code`` of the coordinator's answer to a ``fetch`` it cannot serve
#: (``ref_id``: the digest asked for, in hex).
UNKNOWN_KNOWLEDGE = "unknown_knowledge"
#: ``ErrorReply.code`` of an agent told to stop (SIGTERM, SIGINT) while it ran the task: it
#: sends no result for it; the task runs again if the coordinator sends it again.
STOPPED = "stopped"
#: ``ErrorReply.code`` of an agent whose privacy budget (``hyper.dp``) is spent: it contributes
#: no more, and the coordinator selects it for no further training step of the run. The code
#: is the name of the agent's exception, ``edge_agent.dp.PrivacyBudgetError``.
BUDGET_SPENT = "PrivacyBudgetError"


@dataclass(frozen=True, slots=True)
class ErrorReply(WireModel):
    """Agent -> coordinator (or either way): a task failed or a message was rejected.

    Coordinator -> agent with ``code`` :data:`REFUSED`: the agent is not admitted to the run
    (``reason`` says why, ``ref_id`` is its ``register`` message); it stops. With
    :data:`RATE_LIMITED`: not admitted yet; it may register again later.
    """

    KIND: ClassVar[str] = "error"
    code: str
    reason: str
    task_id: str = ""
    ref_id: str = ""


@dataclass(frozen=True, slots=True)
class Ack(WireModel):
    """Coordinator -> agent: the message ``ref_id`` is durably stored (or was a duplicate)."""

    KIND: ClassVar[str] = "ack"
    ref_id: str
    task_id: str = ""
    accepted: bool = True
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Progress(WireModel):
    """Agent -> coordinator, QoS 0: training progress and heartbeat."""

    KIND: ClassVar[str] = "progress"
    task_id: str
    round: int
    phase: str
    step: int
    total: int
    loss: float = 0.0
    samples_per_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Chunk(WireModel):
    """One piece of a large encoded message, addressed by the SHA-256 of the whole."""

    KIND: ClassVar[str] = "chunk"
    digest: bytes  # SHA-256 of the complete encoded message
    index: int
    count: int
    total_size: int
    data: bytes

    def __post_init__(self) -> None:
        if len(self.digest) != 32:
            raise ValidationError("digest", "32 bytes (SHA-256)", len(self.digest))
        if not 0 <= self.index < self.count:
            raise ValidationError("index", f"0 <= index < count ({self.count})", self.index)
        _non_negative(self.total_size, "total_size")


@dataclass(frozen=True, slots=True)
class ChunkRequest(WireModel):
    """Receiver -> sender: please resend these chunks of ``digest``."""

    KIND: ClassVar[str] = "chunk_req"
    digest: bytes
    missing: list[int]

    def __post_init__(self) -> None:
        if len(self.digest) != 32:
            raise ValidationError("digest", "32 bytes (SHA-256)", len(self.digest))


def payloads_digest(payloads: Mapping[str, Payload]) -> bytes:
    """SHA-256 of a payload map's canonical encoding (``WIRE.md`` §5, ``knowledge``).

    The bytes hashed are :func:`~protocol.contract.payloads.pack_payloads`' (the msgpack map of the
    tagged payloads, §6, names sorted): encoding is canonical and every lossy array encoding
    idempotent, so a receiver that decodes the map and hashes it again gets the sender's digest.
    """
    return hashlib.sha256(pack_payloads(payloads)).digest()


def task_inputs_digest(task: Task) -> bytes:
    """SHA-256 of what ``task`` asks an agent to compute from: run, round, phase, algorithm,
    config and payloads (of a task merged with its knowledge: the merged map).

    Neither the task's id nor its deadline enters: the attempts of one step differ in those
    alone (the coordinator retries a step with the same global state and configuration).
    """
    head = msgpack.packb(
        [task.run_id, task.round, task.phase, task.algorithm, sorted(task.config.items())]
    )
    return hashlib.sha256(head + payloads_digest(task.payloads)).digest()


@dataclass(frozen=True, slots=True)
class Knowledge(WireModel):
    """Coordinator -> every agent: the payloads all tasks of a step share, sent once.

    Retained on ``bcast/knowledge``; sent on ``dev/{id}/down/knowledge`` to an agent that
    fetched it. ``digest`` names it (:func:`payloads_digest` of ``payloads``); a task refers
    to it by ``Task.shared``. Checked on construction, so a decoded one is never mislabelled.
    """

    KIND: ClassVar[str] = "knowledge"
    round: int
    digest: bytes
    payloads: dict[str, Payload] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _non_negative(self.round, "round")
        if len(self.digest) != 32:
            raise ValidationError("digest", "32 bytes (SHA-256)", len(self.digest))
        actual = payloads_digest(self.payloads)
        if actual != self.digest:
            raise ValidationError(
                "digest", f"SHA-256 of the payloads {actual.hex()}", self.digest.hex()
            )

    @classmethod
    def of(cls, round: int, payloads: dict[str, Payload]) -> Knowledge:
        """The knowledge of ``payloads``, its digest computed."""
        return cls(round=round, digest=payloads_digest(payloads), payloads=payloads)


@dataclass(frozen=True, slots=True)
class Fetch(WireModel):
    """Agent -> coordinator: send me the knowledge ``digest`` (a task of mine refers to it)."""

    KIND: ClassVar[str] = "fetch"
    digest: bytes

    def __post_init__(self) -> None:
        if len(self.digest) != 32:
            raise ValidationError("digest", "32 bytes (SHA-256)", len(self.digest))


Message = (
    Register
    | Status
    | CoordinatorState
    | RoundDescriptor
    | Task
    | Reply
    | ErrorReply
    | Ack
    | Progress
    | Chunk
    | ChunkRequest
    | Knowledge
    | Fetch
)
MESSAGE_TYPES: dict[str, type[Any]] = {
    t.KIND: t
    for t in (
        Register,
        Status,
        CoordinatorState,
        RoundDescriptor,
        Task,
        Reply,
        ErrorReply,
        Ack,
        Progress,
        Chunk,
        ChunkRequest,
        Knowledge,
        Fetch,
    )
}
