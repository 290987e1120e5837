"""Typed hyperparameters shared by both halves of an algorithm.

Each algorithm declares one frozen dataclass here, derived from :class:`TrainConfig`. The
coordinator builds it from the run's TOML (unknown keys and wrong types are errors) and sends it
flattened into ``Task.config``; the agent rebuilds it with the same checks. Both halves thus
agree on names and types by construction, not by convention.

The same class declares what each phase's reply carries (:attr:`AlgorithmConfig.REPLY_PAYLOADS`,
a tuple of :class:`PayloadSpec` per phase): the coordinator checks every reply's payload keys
and kinds against it before the strategy looks at shapes.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from protocol.contract.wire import WireModel, from_plain
from protocol.errors import ConfigError, ValidationError

__all__ = [
    "CONFIG_TYPES",
    "DEFAULT_FEATURE_DIM",
    "HTFLLIB_TRAINING",
    "TRAIN_LIMITS",
    "AlgorithmConfig",
    "AveragingConfig",
    "PayloadSpec",
    "ScreeningConfig",
    "TrainConfig",
    "check_payloads",
    "config_type",
    "config_value",
    "register_config",
]

C = TypeVar("C", bound="AlgorithmConfig")
#: An agent's feature size (the projection its model ends in) when neither its flags nor the
#: run's algorithm (:meth:`AlgorithmConfig.model_feature_dim`) fix one.
DEFAULT_FEATURE_DIM = 64
Scalar = bool | int | float | str


@dataclass(frozen=True)
class PayloadSpec:
    """One named payload a reply carries: its key, its payload class and whether it must be there.

    ``kind`` is a class from :mod:`protocol.contract.payloads` (``PrototypeSet``, ``TensorMap``,
    ...).
    """

    key: str
    kind: type[WireModel]
    required: bool = True


def check_payloads(
    specs: tuple[PayloadSpec, ...], payloads: Mapping[str, WireModel], phase: str
) -> None:
    """Raise :class:`ValidationError` naming the first key that is unknown, missing or of the
    wrong kind in a ``phase`` reply."""
    declared = {s.key: s for s in specs}
    for key, value in payloads.items():
        spec = declared.get(key)
        if spec is None:
            known = f"one of {sorted(declared)}" if declared else "no payload"
            raise ValidationError(f"reply.payloads.{key}", f"{known} in phase {phase}", value.KIND)
        if not isinstance(value, spec.kind):
            raise ValidationError(
                f"reply.payloads.{key}", f"a {spec.kind.KIND} payload", value.KIND
            )
    for spec in specs:
        if spec.required and spec.key not in payloads:
            raise ValidationError(
                f"reply.payloads.{spec.key}",
                f"a {spec.kind.KIND} payload (required in phase {phase})",
                "nothing",
            )


@dataclass(frozen=True)
class AlgorithmConfig:
    """Base of every algorithm config: flat scalar fields only."""

    NAME: ClassVar[str] = ""
    #: Phase -> the payloads of that phase's replies; a phase absent here carries none.
    #: ``None``: not declared, replies are not checked (an algorithm still being written).
    REPLY_PAYLOADS: ClassVar[dict[str, tuple[PayloadSpec, ...]] | None] = None
    #: Named sets of values for some of the fields (preset -> key -> value), chosen by
    #: ``run.preset``: another toolkit's settings for this algorithm (``htfllib``), while the
    #: defaults stay the paper's. Each value is checked like any other when the run is built.
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}

    @classmethod
    def preset(cls, name: str) -> dict[str, Any]:
        """The values of preset ``name`` (``""``: none); an unknown name is a
        :class:`ConfigError` listing this algorithm's presets."""
        if not name:
            return {}
        values = cls.PRESETS.get(name)
        if values is None:
            raise ConfigError(
                f"run.preset: {cls.NAME or cls.__name__} has no preset {name!r}; "
                f"its presets: {sorted(cls.PRESETS) or 'none'}"
            )
        return dict(values)

    @classmethod
    def reply_payloads(cls, phase: str) -> tuple[PayloadSpec, ...] | None:
        """What a ``phase`` reply carries (``None``: the algorithm declares nothing)."""
        if cls.REPLY_PAYLOADS is None:
            return None
        return cls.REPLY_PAYLOADS.get(phase, ())

    @classmethod
    def from_dict(cls: type[C], values: dict[str, Any], *, where: str = "config") -> C:
        """Build from a flat mapping, rejecting unknown keys and mistyped values."""
        hints = _field_types(cls)
        unknown = sorted(set(values) - set(hints))
        if unknown:
            raise ConfigError(
                f"{where}: unknown key(s) {unknown} for {cls.NAME or cls.__name__}; "
                f"known: {sorted(hints)}"
            )
        kwargs = {k: config_value(hints[k], v, f"{where}.{k}") for k, v in values.items()}
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: {exc}") from exc

    def model_feature_dim(self, num_classes: int) -> int:
        """The feature size every agent's model must have in a run of this config with
        ``num_classes`` classes (0: each agent's own). The coordinator refuses another size at
        registration and announces this one, so that an agent adopting the run builds it."""
        return 0

    def to_dict(self) -> dict[str, Scalar]:
        """Flat mapping of every field."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def task_config(self) -> dict[str, Scalar]:
        """:meth:`to_dict` less the :data:`OMITTED_AT_DEFAULT` fields at their defaults: what
        a task carries (the receiver's :meth:`from_dict` fills them in), so that a setting
        left off costs no bytes and changes no frame."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return {
            k: v
            for k, v in self.to_dict().items()
            if k not in OMITTED_AT_DEFAULT or v != defaults[k]
        }

    def replace(self: C, **changes: Any) -> C:
        """A copy with ``changes`` applied and validated."""
        return type(self).from_dict({**self.to_dict(), **changes})


_FIELD_TYPES: dict[type, dict[str, Any]] = {}


def _field_types(cls: type) -> dict[str, Any]:
    # get_type_hints re-evaluates string annotations: too slow to repeat per message
    hints = _FIELD_TYPES.get(cls)
    if hints is None:
        all_hints = typing.get_type_hints(cls)
        hints = {f.name: all_hints[f.name] for f in dataclasses.fields(cls)}
        _FIELD_TYPES[cls] = hints
    return hints


def config_value(tp: Any, value: Any, where: str) -> Any:
    """``value`` checked and converted to the config field type ``tp`` by the one typed decoder
    (:func:`protocol.contract.wire.from_plain`); a mismatch is a :class:`ConfigError` showing the
    value
    as given, since a config value is a user's word, not a peer's."""
    try:
        return from_plain(tp, value, where)
    except ValidationError as exc:
        shown = f"{type(value).__name__} {value!r}"
        raise ConfigError(f"{where}: expected {exc.expected}, got {shown}") from None


#: Inclusive ranges of the common training settings: a task outside them is refused
#: by the coordinator (run config) and by the agent (task config) with a ConfigError, instead of
#: being executed. Generous for real runs; tight enough that one task cannot occupy a device
#: for days (``local_epochs=100000``) or exhaust its memory (``batch_size``).
TRAIN_LIMITS: dict[str, tuple[float, float]] = {
    "local_epochs": (0, 1000),
    "batch_size": (1, 8192),
    "lr": (0.0, 10.0),  # and > 0
    "momentum": (0.0, 1.0),
    "weight_decay": (0.0, 1.0),
    "grad_clip": (0.0, 1e6),
    "eval_every": (1, 1_000_000),
    "validation_fraction": (0.0, 0.5),
}


#: Task config keys left out at their defaults (:meth:`AlgorithmConfig.task_config`): optional
#: features whose keys an agent that predates them would refuse, and that cost no bytes off
OMITTED_AT_DEFAULT = frozenset(
    {
        "dp_epsilon",
        "dp_delta",
        "dp_clip",
        "dp_mechanism",
        "dp_releases",
        "dp_share",
        "dp_regulariser",
        "validation_fraction",
    }
)
DP_MECHANISMS = ("gaussian",)


@dataclass(frozen=True)
class TrainConfig(AlgorithmConfig):
    """Settings of the one local training loop, common to every algorithm."""

    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    optimizer: typing.Literal["sgd", "adam"] = "sgd"
    grad_clip: float = 0.0  # max gradient norm; 0 = off
    mixed_precision: bool = False  # autocast on CUDA; ignored on CPU
    # the loader: "shuffle" draws a new order each epoch; "fixed" reuses one seeded order every
    # epoch and round (HtFLlib's clients iterate an unshuffled loader over a split that was
    # shuffled once). drop_last skips each epoch's last, partial batch (HtFLlib's does)
    batch_order: typing.Literal["shuffle", "fixed"] = "shuffle"
    drop_last: bool = False
    # the run's evaluation cadence: agents evaluate every N-th training round (other phases and
    # the final step always); an agent's own --eval-every, if larger, wins. Evaluating the
    # global test set every round can dominate a round's time
    eval_every: int = 1
    # share of each device's training data held out as its validation split (seeded by the
    # device id, class-stratified; never trained on, never test data): the agents report
    # acc_val on it, keep their best round's checkpoint by it and export that one. 0 = none
    validation_fraction: float = 0.0
    # True: every agent of one architecture starts from the same weights, seeded by the
    # architecture and input alone (HtFLlib's torch.manual_seed(0) before every client's
    # model); False: each agent starts from its own seed, unless the algorithm shares the
    # model anyway (FedAvg, CCVR: the weights it averages)
    arch_init: bool = False
    # differential privacy of the per-class sums a reply carries (hyper.dp.*, written
    # dp_* here; docs/concepts/privacy.md): each device's total budget over the run (0: off),
    # at dp_delta; each sample's contribution to a class's sum clipped to L2 norm dp_clip;
    # the noise calibrated so that dp_releases releases spend the budget (0: the run's rounds)
    dp_epsilon: float = 0.0
    dp_delta: float = 1e-5
    dp_clip: float = 1.0
    dp_mechanism: typing.Literal["gaussian"] = "gaussian"
    dp_releases: int = 0
    # where a device's replies carry both (weights DP-SGD trains and per-class sums): the
    # share of dp_epsilon the sums' noise is calibrated for; DP-SGD's noise then takes the
    # rest, calibrated on the composition of both (edge_agent.dp)
    dp_share: float = 0.5
    #: The algorithm's replies carry per-class sums through the edge's one private release
    #: (``edge_agent.dp``), so ``dp_epsilon`` may be set; else it is refused.
    DP_STATISTICS: typing.ClassVar[bool] = False
    #: The algorithm's replies carry weights of modules the main training step trains: with
    #: ``dp_epsilon`` set, that step is DP-SGD's (``edge_agent.dp_sgd``); else it is refused.
    DP_SGD: typing.ClassVar[bool] = False
    # an algorithm's own size settings, bounded like TRAIN_LIMITS: a task from the wire may not
    # ask a device for unbounded work (docs/concepts/security.md)
    LIMITS: typing.ClassVar[dict[str, tuple[float, float]]] = {}

    def __post_init__(self) -> None:
        for key, (lo, hi) in {**TRAIN_LIMITS, **self.LIMITS}.items():
            value = getattr(self, key)
            if not lo <= value <= hi:
                raise ValueError(f"{key} must be in [{lo:g}, {hi:g}], got {value!r}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        self._check_dp()

    def _check_dp(self) -> None:
        if not 0 <= self.dp_epsilon <= 1e3:
            raise ValueError(f"dp.epsilon must be in [0, 1000] (0 = off), got {self.dp_epsilon!r}")
        if not (0 < self.dp_delta < 1 and 0 < self.dp_clip <= 1e6):
            raise ValueError(
                f"dp.delta must be in (0, 1) and dp.clip in (0, 1e+06], got "
                f"{self.dp_delta!r} and {self.dp_clip!r}"
            )
        if not 0 <= self.dp_releases <= 1_000_000:
            raise ValueError(f"dp.releases must be in [0, 1000000], got {self.dp_releases!r}")
        if not 0 < self.dp_share < 1:
            raise ValueError(f"dp.share must be in (0, 1), got {self.dp_share!r}")
        uncovered = self.dp_uncovered()
        if self.dp_epsilon > 0 and uncovered:
            raise ValueError(f"dp.epsilon is set, but {uncovered}")

    def dp_sgd_trains(self) -> bool:
        """Whether, under ``hyper.dp``, the main training step is DP-SGD's: weights it trains
        leave the device (default: :attr:`DP_SGD`)."""
        return self.DP_SGD

    def dp_statistics_releases(self, releases: int) -> int:
        """How many releases of per-class sums a device makes in a run whose budget is spread
        over ``releases`` releases (default: one a release where :attr:`DP_STATISTICS`)."""
        return releases if self.DP_STATISTICS else 0

    def dp_statistics_epsilon(self) -> float:
        """The part of ``dp_epsilon`` the per-class sums' noise is calibrated for: all of it,
        or ``dp_share`` of it where DP-SGD trains weights that leave too."""
        both = self.DP_STATISTICS and self.dp_sgd_trains()
        return self.dp_epsilon * self.dp_share if both else self.dp_epsilon

    def dp_uncovered(self) -> str:
        """Why this config's replies would carry something the private release does not
        cover (``""``: nothing)."""
        if self.DP_STATISTICS or self.DP_SGD:
            return ""
        return (
            f"{self.NAME or type(self).__name__}'s replies are neither per-class sums nor "
            "weights DP-SGD trains; differential privacy covers only those"
        )


#: HtFLlib's client training, common to every algorithm of its ``total.sh``
#: (docs/algorithms/baselines.md names the source of each value): plain SGD at lr 0.01, batch
#: 10, one local epoch, an unshuffled loader that drops the last partial batch, and one start
#: per architecture.
HTFLLIB_TRAINING: dict[str, Any] = {
    "optimizer": "sgd",
    "lr": 0.01,
    "momentum": 0.0,
    "batch_size": 10,
    "local_epochs": 1,
    "batch_order": "fixed",
    "drop_last": True,
    "arch_init": True,
}


@dataclass(frozen=True)
class AveragingConfig(TrainConfig):
    """Settings of every algorithm whose server averages uploads (weights, prototypes, logits,
    features): how the uploads of a round are combined (``docs/concepts/security.md``).

    The coordinator alone reads these; they travel in the task config like every field.
    """

    # mean: the algorithm's own (sample-weighted or plain) mean, the default and the paper's
    # rule; median: coordinate-wise median (unweighted); trimmed_mean: per coordinate, drop the
    # trim_fraction lowest and highest values, average the rest (sample-weighted)
    aggregation: typing.Literal["mean", "median", "trimmed_mean"] = "mean"
    trim_fraction: float = 0.1  # share of the uploads dropped at each end; in [0, 0.5)
    # 0 = off; else each upload's deviation from the round's coordinate-wise median is clipped
    # to clip_norm x the median deviation norm before the mean, median or trimmed mean
    clip_norm: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.trim_fraction < 0.5:
            raise ValueError(f"trim_fraction must be in [0, 0.5), got {self.trim_fraction!r}")
        if not 0 <= self.clip_norm <= 1e6:
            raise ValueError(f"clip_norm must be in [0, 1e+06] (0 = off), got {self.clip_norm!r}")


@dataclass(frozen=True)
class ScreeningConfig(TrainConfig):
    """Settings of every algorithm whose server trains on individual uploads (FedKTL's F,
    FedTGP's generator, FedGH's head): which uploads it trains on (``docs/concepts/security.md``).

    The coordinator alone reads this; it travels in the task config like every field.
    """

    # 0 = off (train on every accepted upload, the papers' rule); else, per class held by at
    # least 3 uploads, an upload farther from the class's coordinate-wise median than
    # upload_screen x the median of those distances is left out of the round's server training
    upload_screen: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.upload_screen == 0 or 1 <= self.upload_screen <= 1e6):
            raise ValueError(
                f"upload_screen must be 0 (off) or in [1, 1e+06], got {self.upload_screen!r}"
            )


CONFIG_TYPES: dict[str, type[AlgorithmConfig]] = {}


def register_config(name: str) -> typing.Callable[[type[C]], type[C]]:
    """Class decorator: register ``cls`` as the config of algorithm ``name``."""

    def deco(cls: type[C]) -> type[C]:
        if name in CONFIG_TYPES:
            raise ValueError(f"algorithm config {name!r} registered twice")
        cls.NAME = name
        CONFIG_TYPES[name] = cls
        return cls

    return deco


def config_type(name: str) -> type[AlgorithmConfig]:
    """The config class of algorithm ``name`` (a :class:`ConfigError` lists the known ones)."""
    try:
        return CONFIG_TYPES[name]
    except KeyError:
        raise ConfigError(f"unknown algorithm {name!r}; known: {sorted(CONFIG_TYPES)}") from None
