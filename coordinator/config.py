"""The run configuration: one TOML file plus ``--set section.key=value`` overrides.

```toml
[run]
algorithm = "fedproto"
rounds = 10
preset = "htfllib"   # optional: a named set of [hyper] values (the algorithm's PRESETS)

[hyper]          # the algorithm's typed hyperparameters (protocol.algorithms)
lr = 0.05
```

Unknown keys and wrong types are errors, never silently ignored. A ``run.preset`` gives the
algorithm's named hyperparameter values; ``[hyper]`` and ``--set hyper.KEY=VALUE`` override
them key by key.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.accuracy import MONITORS, PERSONALISED, VALIDATION
from coordinator.engine.staleness import StalenessRule
from coordinator.tracking.follow import TRACKERS
from protocol.algorithms import AlgorithmConfig, config_type
from protocol.algorithms.base import config_value
from protocol.errors import ConfigError
from protocol.security.signing import DEFAULT_WINDOW

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (JetPack 6)
    import tomli as tomllib

__all__ = [
    "RunConfig",
    "build_config",
    "load_config",
    "parse_override",
    "preset_differences",
    "read_layers",
    "run_keys",
]

_SERVER_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
MQTT_CLIENTS = ("lean", "paho")
MODES = ("sync", "buffered")
MAX_HEARTBEAT_S = DEFAULT_WINDOW / 2  # a late joiner must find the retained state fresh
# run.monitor's default: the validation accuracy where the agents hold a validation split
# (hyper.validation_fraction > 0), else personalised test accuracy
AUTO_MONITOR = "auto"


@dataclass(frozen=True)
class RunConfig:
    """How a run is driven: algorithm, rounds, participation, quorum, deadlines, storage."""

    algorithm: str = "fedproto"
    rounds: int = 10
    # a named set of hyperparameter values of the algorithm (its PRESETS), under [hyper] and
    # --set: "" = none (the algorithm's defaults, its paper's); "htfllib" = HtFLlib's settings
    preset: str = ""
    fraction: float = 1.0  # share of online agents selected each training round
    min_agents: int = 2  # agents that must have registered before the first round
    min_replies: int = 1  # quorum: valid replies needed to aggregate a step
    quorum_fraction: float = 0.5  # quorum: share of the selected agents that must reply
    deadline_s: float = 120.0  # per step, from the tasks' dispatch (adaptive: the cap)
    # "adaptive": each step's deadline from the reply times of the steps before
    # (coordinator/engine/deadlines.py), between deadline_min_s and deadline_s
    deadline_mode: str = "fixed"
    deadline_quantile: float = 0.9
    deadline_margin: float = 1.5
    deadline_min_s: float = 5.0
    grace_s: float = 2.0  # extra wait after the deadline for replies already in flight
    wait_agents_s: float = 300.0  # how long to wait for min_agents before giving up
    # before each later step, how long to wait for min_agents to be online again (an agent
    # that restarted mid-run rejoins); the step then goes ahead with the agents online
    rejoin_wait_s: float = 10.0
    # with signed frames, the retained coordinator state is published again this often, well
    # inside the signature window, so that agents joining later never see it stale (WIRE.md §7)
    state_heartbeat_s: float = 60.0
    max_retries: int = 2  # re-runs of a step that missed quorum before the run stops
    # new device ids admitted in all; past that a registration of a new id is refused (without
    # signing anyone may register: the bound on what a flood of forged devices can join)
    max_agents: int = 10_000
    # new device ids admitted a minute (0: no limit); the run's own min_agents may come at once
    max_registrations_per_min: int = 1_000
    seed: int = 0
    num_classes: int = 10
    # the classes by name, in order (empty: undeclared); agents must name theirs the same
    classes: tuple[str, ...] = ()
    federation: str = "default"
    run_id: str = "run"
    run_dir: str = "runs/run"
    broker: str = ""  # host[:port]; empty = start the embedded broker
    embedded_port: int = 1883
    embedded_host: str = "127.0.0.1"  # the embedded broker has no authentication
    # where server_train runs: "auto" = cuda when torch sees a GPU, else cpu (resolved only
    # when a strategy asks, so runs without server training never import torch)
    server_device: str = "auto"
    # knowledge that is the same object in the tasks of a step goes once on bcast/knowledge
    # (WIRE.md §5), each task carrying its digest: per-round egress independent of the fleet
    broadcast: bool = True
    broadcast_min_bytes: int = 1024  # smaller shared payloads stay in the tasks (0: none do)
    # 0: this process takes the replies. N: N `coordinator ingest-worker` processes take them
    # through an MQTT shared subscription and store them; this process leads the rounds
    ingest_workers: int = 0
    # the coordinator's MQTT client: "lean" (protocol.transport.lean_mqtt, MQTT 3.1.1 over a socket
    # of
    # our own: ~5x less CPU a message than paho, benchmarks/bench_mqtt_clients.py) or "paho"
    mqtt_client: str = "lean"
    # early stopping (0: off, every round runs): training ends once the best round of
    # `monitor` is `patience` rounds old, `rounds` being the cap; the final steps still run
    patience: int = 0
    min_delta: float = 0.0  # an improvement must exceed the best so far by more than this
    # "auto": acc_val_weighted with a validation split, else acc_local_weighted (`monitored`)
    monitor: str = AUTO_MONITOR
    stop_target: float = 0.0  # training ends once `monitor` reaches this; 0 = off
    # experiment trackers fed from metrics.jsonl as it grows (optional extras; coordinator.tracking)
    trackers: tuple[str, ...] = ()
    tracking_uri: str = ""  # MLflow's tracking URI; "" = a file store in RUN_DIR/mlruns
    # "sync": every round waits for its quorum; "buffered": semi-asynchronous (FedBuff), a
    # global update every buffer_size replies, stale ones weighted (coordinator/engine/staleness.py)
    mode: str = "sync"
    buffer_size: int = 10
    staleness: str = "polynomial"  # constant | polynomial (1 + s)^-a | hinge
    staleness_a: float = 0.5
    staleness_b: float = 4.0
    max_staleness: int = 10  # a reply more global versions old than this is refused
    hyper: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rounds < 0 or self.min_agents < 1 or self.min_replies < 1 or self.max_retries < 0:
            raise ConfigError(
                "run: rounds >= 0, min_agents >= 1, min_replies >= 1, max_retries >= 0"
            )
        if not 0 < self.fraction <= 1 or not 0 <= self.quorum_fraction <= 1:
            raise ConfigError("run: fraction must be in (0, 1] and quorum_fraction in [0, 1]")
        if self.deadline_s <= 0 or self.grace_s < 0 or self.num_classes < 1:
            raise ConfigError("run: deadline_s > 0, grace_s >= 0, num_classes >= 1")
        _check_classes(self.classes, self.num_classes)
        if not 0 < self.state_heartbeat_s <= MAX_HEARTBEAT_S:
            raise ConfigError(
                f"run.state_heartbeat_s: expected a value in (0, {MAX_HEARTBEAT_S:g}] seconds "
                f"(half the {DEFAULT_WINDOW:g} s signature window), got {self.state_heartbeat_s}"
            )
        if not self.min_agents <= self.max_agents or self.max_registrations_per_min < 0:
            raise ConfigError(
                f"run: max_agents >= min_agents ({self.min_agents}) and "
                f"max_registrations_per_min >= 0; got {self.max_agents}, "
                f"{self.max_registrations_per_min}"
            )
        if self.ingest_workers < 0:
            raise ConfigError(
                f"run.ingest_workers: expected an int >= 0, got {self.ingest_workers}"
            )
        if self.mqtt_client not in MQTT_CLIENTS:
            raise ConfigError(
                f"run.mqtt_client: expected one of {', '.join(MQTT_CLIENTS)}, "
                f"got {self.mqtt_client!r}"
            )
        if self.broadcast_min_bytes < 0:
            raise ConfigError(
                f"run.broadcast_min_bytes: expected an int >= 0, got {self.broadcast_min_bytes}"
            )
        if not _SERVER_DEVICE.fullmatch(self.server_device):
            raise ConfigError(
                f"run.server_device: expected auto, cpu, cuda or cuda:N, got {self.server_device!r}"
            )
        self._check_stopping()
        adaptive = self.deadline_mode == "adaptive"
        if self.deadline_mode not in ("fixed", "adaptive") or not (
            0 < self.deadline_quantile <= 1
            and self.deadline_margin >= 1
            and self.deadline_min_s > 0
            and (self.deadline_min_s <= self.deadline_s or not adaptive)
        ):
            raise ConfigError(
                "run: deadline_mode fixed or adaptive, deadline_quantile in (0, 1], "
                "deadline_margin >= 1, 0 < deadline_min_s (<= deadline_s when adaptive); got "
                f"{self.deadline_mode!r}, {self.deadline_quantile}, {self.deadline_margin}, "
                f"{self.deadline_min_s}"
            )
        unknown = sorted(set(self.trackers) - set(TRACKERS))
        if unknown:
            raise ConfigError(
                f"run.trackers: unknown {unknown}; known: {', '.join(TRACKERS)} (the `tracking` "
                "extra installs their libraries)"
            )
        self._check_mode()
        self.algorithm_config()  # validates the hyperparameters against the algorithm

    def _check_stopping(self) -> None:
        monitors = (AUTO_MONITOR, *MONITORS)
        if self.patience < 0 or self.min_delta < 0 or self.monitor not in monitors:
            raise ConfigError(
                f"run: patience >= 0, min_delta >= 0, monitor one of {', '.join(monitors)}; "
                f"got {self.patience}, {self.min_delta}, {self.monitor!r}"
            )
        if not 0 <= self.stop_target <= 1:
            raise ConfigError(
                f"run.stop_target: expected an accuracy in (0, 1] (0: off), got {self.stop_target}"
            )
        if self.monitor == VALIDATION and self.validation_fraction() <= 0:
            raise ConfigError(
                f"run.monitor = {VALIDATION!r} watches the agents' validation accuracy, and "
                "hyper.validation_fraction is 0 (no validation split): set "
                "hyper.validation_fraction (e.g. 0.1) or choose another run.monitor"
            )

    def validation_fraction(self) -> float:
        """The share of each agent's training data it holds out for validation (0: none)."""
        return float(getattr(self.algorithm_config(), "validation_fraction", 0.0))

    @property
    def monitored(self) -> str:
        """The metric early stopping watches: ``monitor``, with ``auto`` resolved."""
        if self.monitor != AUTO_MONITOR:
            return self.monitor
        return VALIDATION if self.validation_fraction() > 0 else PERSONALISED

    def _check_mode(self) -> None:
        if self.mode not in MODES or self.buffer_size < 1:
            raise ConfigError(
                f"run: mode one of {', '.join(MODES)}, buffer_size >= 1; got {self.mode!r}, "
                f"{self.buffer_size}"
            )
        self.staleness_rule()  # validates the staleness keys
        if self.mode == "buffered":  # refused here, before any agent or broker starts
            from coordinator.strategies import check_mode

            check_mode(self.algorithm, self.mode)
        if self.mode == "buffered" and self.ingest_workers:
            raise ConfigError(
                "run.mode = buffered takes the replies in the coordinator itself: ingest "
                "workers judge replies against one round's tasks only (set run.ingest_workers = 0)"
            )

    def staleness_rule(self) -> StalenessRule:
        """The staleness weight and bound of buffered mode."""
        return StalenessRule(self.staleness, self.staleness_a, self.staleness_b, self.max_staleness)

    def algorithm_config(self) -> AlgorithmConfig:
        """The typed hyperparameters of the chosen algorithm: its defaults, then the preset's
        values, then the run's ``hyper``."""
        cls = config_type(self.algorithm)
        values = {**cls.preset(self.preset), **flat_hyper(self.hyper)}
        if values.get("dp_epsilon") and not values.get("dp_releases"):
            values["dp_releases"] = self.rounds  # the budget spread over the run's rounds
        return cls.from_dict(values, where="hyper")

    def required_feature_dim(self) -> int:
        """The feature size the algorithm requires of every agent's model (0: none)."""
        return self.algorithm_config().model_feature_dim(self.num_classes)

    def replace(self, **changes: Any) -> RunConfig:
        """A validated copy with ``changes``."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (recorded with the run)."""
        out = dataclasses.asdict(self)
        out["hyper"] = self.algorithm_config().to_dict()
        out["classes"] = list(self.classes)
        out["trackers"] = list(self.trackers)
        return out


def _check_classes(classes: tuple[str, ...], num_classes: int) -> None:
    if not classes:
        return
    if len(classes) != num_classes:
        raise ConfigError(
            f"run.classes names {len(classes)} classes but run.num_classes is {num_classes}; "
            "leave num_classes out (it defaults to the number of classes) or make them agree"
        )
    bad = [c for c in classes if not isinstance(c, str) or not 1 <= len(c) <= 128]
    if bad:
        raise ConfigError(f"run.classes: names must be 1..128 characters, got {bad[:3]}")
    dup = sorted({c for c in classes if classes.count(c) > 1})
    if dup:
        raise ConfigError(f"run.classes: duplicate class names {dup}")


# One line per [run] key for `coordinator config --defaults`; a test keeps it complete.
RUN_KEY_HELP: dict[str, str] = {
    "algorithm": "the algorithm both halves run (fedproto, fedvtc, felo, ...)",
    "rounds": "training rounds (final phases come after them)",
    "preset": 'named [hyper] values of the algorithm, under [hyper] and --set: "" (none: '
    "the paper's defaults) or \"htfllib\" (HtFLlib's total.sh; docs/algorithms/baselines.md)",
    "fraction": "share of the online agents selected each training round, in (0, 1]",
    "min_agents": "agents that must be registered and online before the first round",
    "min_replies": "quorum: valid replies a step needs at least",
    "quorum_fraction": "quorum: share of the selected agents that must reply, in [0, 1]",
    "deadline_s": "seconds a step waits for replies after dispatching its tasks (adaptive "
    "deadlines: the longest a step waits)",
    "deadline_mode": "fixed (deadline_s) or adaptive: each step waits deadline_quantile of the "
    "recent reply times x deadline_margin, between deadline_min_s and deadline_s",
    "deadline_quantile": "adaptive deadlines: the quantile of the last 200 reply times",
    "deadline_margin": "adaptive deadlines: the factor on that quantile (>= 1)",
    "deadline_min_s": "adaptive deadlines: the shortest a step waits",
    "grace_s": "extra seconds after the deadline for replies already in flight",
    "wait_agents_s": "seconds to wait for min_agents before the run gives up",
    "rejoin_wait_s": "seconds each later step waits for min_agents to be online again",
    "state_heartbeat_s": "seconds between re-publications of the retained coordinator state "
    "(signed afresh where signing is on; at most half the 300 s signature window)",
    "max_retries": "re-runs of a step that missed its quorum before the run stops",
    "max_agents": "devices the run admits in all; a new device past it is refused",
    "max_registrations_per_min": "new devices admitted a minute (min_agents may register at "
    "once); past it a registration is answered rate_limited; 0 = no limit",
    "seed": "seed of selection and server-side training",
    "num_classes": "classes of the federation's task; every agent must have as many",
    "classes": 'the classes by name, in order (e.g. ["cat", "dog"] or "cat,dog"); '
    "agents must name theirs the same, agents without --classes adopt them",
    "federation": "federation name: the MQTT topic namespace agents join",
    "run_id": "the run's name (default: the run directory's name)",
    "run_dir": "where state, metrics and exports go (default: runs/COMMAND-TIMESTAMP)",
    "broker": "MQTT broker host[:port]; empty = start an embedded broker",
    "embedded_port": "port of the embedded broker",
    "embedded_host": "embedded broker interface; 127.0.0.1 keeps it local (no authentication)",
    "server_device": "where server-side training runs: auto, cpu, cuda or cuda:N",
    "broadcast": "send knowledge shared by a step's tasks once on the broadcast topic "
    "(false: inside every task)",
    "broadcast_min_bytes": "shared payloads smaller than this (encoded) stay inside the tasks; "
    "0 broadcasts every shared payload",
    "ingest_workers": "0: the coordinator takes the replies itself; N: it waits for N "
    "`coordinator ingest-worker` processes, which take them over a shared subscription",
    "mqtt_client": "the coordinator's MQTT client: lean (our socket client, built for fleet "
    "scale) or paho",
    "patience": "early stopping: end training once the best round of `monitor` is this many "
    "rounds old, then run the final steps (rounds is the cap); 0 = off",
    "min_delta": "early stopping: how much a round must beat the best so far to count",
    "monitor": "early stopping's metric: acc_val_weighted (the agents' validation accuracy, "
    "sample-weighted; needs hyper.validation_fraction), acc_local_weighted (personalised test "
    "accuracy, sample-weighted) or acc_global (mean over the agents); auto = acc_val_weighted "
    "when hyper.validation_fraction > 0, else acc_local_weighted",
    "stop_target": "early stopping: end training once `monitor` reaches this accuracy, then run "
    "the final steps; 0 = off",
    "trackers": 'experiment trackers fed as the run goes: "mlflow", "tensorboard" (e.g. '
    '["mlflow"] or "mlflow,tensorboard"; the `tracking` extra); a failing tracker never stops '
    "the run",
    "tracking_uri": 'MLflow tracking URI (e.g. http://HOST:5000); "" = a file store in '
    "RUN_DIR/mlruns",
    "mode": "sync (each round waits for its quorum) or buffered (semi-asynchronous: a global "
    "update every buffer_size replies, a device gets its next task once its reply is folded)",
    "buffer_size": "buffered mode: replies folded into each global update",
    "staleness": "buffered mode: weight of a reply s versions old: constant (1), polynomial "
    "((1 + s)^-a) or hinge (1 if s <= b, else 1 / (a (s - b) + 1))",
    "staleness_a": "buffered mode: the a of the polynomial and hinge staleness weights",
    "staleness_b": "buffered mode: the b of the hinge staleness weight",
    "max_staleness": "buffered mode: a reply more global versions old than this is refused "
    "(stale) and its device gets a fresh task",
}


def run_keys() -> list[tuple[str, str, Any, str]]:
    """(key, type, default, meaning) of every [run] key, in declaration order."""
    defaults = RunConfig()
    return [
        (name, _type_name(hint), getattr(defaults, name), RUN_KEY_HELP.get(name, ""))
        for name, hint in _run_fields().items()
    ]


def preset_differences(name: str) -> list[tuple[str, str, Any, Any]]:
    """(algorithm, key, default, preset value) of every value that preset ``name`` changes,
    by algorithm and key: what ``coordinator config --defaults`` shows under each preset."""
    from protocol.algorithms import CONFIG_TYPES

    out = []
    for algorithm, cls in sorted(CONFIG_TYPES.items()):
        if name not in cls.PRESETS:
            continue
        defaults = cls().to_dict()
        for key, value in sorted(cls.PRESETS[name].items()):
            if defaults[key] != value:
                out.append((algorithm, key, defaults[key], value))
    return out


def hyper_keys(algorithm: str) -> list[tuple[str, str, Any, str]]:
    """(key, type, default, allowed range) of every [hyper] key of ``algorithm``, in
    declaration order: what ``coordinator config --defaults --algorithm NAME`` shows."""
    from protocol.algorithms import config_type
    from protocol.algorithms.base import TRAIN_LIMITS

    cls = config_type(algorithm)
    hints = typing.get_type_hints(cls)
    defaults = cls().to_dict()
    limits: dict[str, tuple[float, float]] = {**TRAIN_LIMITS, **getattr(cls, "LIMITS", {})}
    out = []
    for f in dataclasses.fields(cls):
        lo_hi = limits.get(f.name)
        bounds = "" if lo_hi is None else f"[{lo_hi[0]:g}, {lo_hi[1]:g}]"
        out.append((f.name, _type_name(hints[f.name]), defaults[f.name], bounds))
    return out


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return "|".join(str(v) for v in typing.get_args(hint))
    return hint.__name__ if isinstance(hint, type) else str(hint)


def flat_hyper(hyper: dict[str, Any]) -> dict[str, Any]:
    """``[hyper.dp]`` sections and ``hyper.dp.epsilon`` keys as the configs' flat fields
    (``dp_epsilon``): a config travels as flat scalars."""
    out: dict[str, Any] = {}
    for key, value in hyper.items():
        name = key.replace(".", "_")
        if isinstance(value, dict):
            out.update({f"{name}_{k}": v for k, v in flat_hyper(value).items()})
        else:
            out[name] = value
    return out


def _run_fields() -> dict[str, Any]:
    hints = typing.get_type_hints(RunConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(RunConfig) if f.name != "hyper"}


def parse_override(text: str) -> tuple[str, str, Any]:
    """``"run.rounds=5"`` -> ``("run", "rounds", 5)``; values are TOML literals or bare strings."""
    key, sep, raw = text.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or section not in ("run", "hyper") or not name:
        raise ConfigError(f"--set {text!r}: expected run.KEY=VALUE or hyper.KEY=VALUE")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return section, name, value


def read_layers(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), **direct: Any
) -> dict[str, dict[str, Any]]:
    """The values a user gave, unvalidated: ``{"run": {...}, "hyper": {...}}``.

    Later layers win: the TOML file, then ``--set`` overrides, then ``direct`` keyword values
    (``None`` means "not given"). Callers need this to tell a chosen value from a default
    (``run_dir``, or a resumed run whose settings must not change).
    """
    data: dict[str, dict[str, Any]] = {"run": {}, "hyper": {}}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: invalid TOML: {exc}") from exc
        unknown = sorted(set(loaded) - {"run", "hyper"})
        if unknown:
            raise ConfigError(f"{p}: unknown section(s) {unknown}; expected [run] and [hyper]")
        for section in ("run", "hyper"):
            data[section].update(loaded.get(section, {}))
    for text in overrides:
        section, name, value = parse_override(text)
        data[section][name] = value
    data["run"].update({k: v for k, v in direct.items() if v is not None})
    return data


def build_config(data: dict[str, dict[str, Any]], base: dict[str, Any] | None = None) -> RunConfig:
    """Validate ``data`` (from :func:`read_layers`) over ``base`` (e.g. a stored run's config)."""
    base = dict(base or {})
    base_hyper = dict(base.pop("hyper", None) or {})
    run = {**base, **data["run"]}
    fields = _run_fields()
    unknown = sorted(set(run) - set(fields))
    if unknown:
        raise ConfigError(f"[run]: unknown key(s) {unknown}; known: {sorted(fields)}")
    typed = {k: _coerce_run(k, v, fields[k]) for k, v in run.items()}
    if typed.get("classes") and "num_classes" not in data["run"]:
        typed["num_classes"] = len(typed["classes"])  # declared by name: count them
    algorithm = typed.get("algorithm", RunConfig.algorithm)
    # a stored run's hyperparameters belong to its algorithm: another algorithm starts afresh
    hyper = base_hyper if base.get("algorithm", algorithm) == algorithm else {}
    return RunConfig(**typed, hyper={**hyper, **data["hyper"]})


def _coerce_run(key: str, value: Any, hint: Any) -> Any:
    if key not in ("classes", "trackers"):
        return config_value(hint, value, f"run.{key}")
    if isinstance(value, str):  # --set run.classes=cat,dog
        value = [] if not value.strip() else [n.strip() for n in value.split(",")]
    if not isinstance(value, (list, tuple)) or not all(isinstance(n, str) for n in value):
        what = "class names" if key == "classes" else "tracker names"
        raise ConfigError(f"run.{key}: expected a list of {what}, got {value!r}")
    return tuple(value)


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), **direct: Any
) -> RunConfig:
    """Read ``path`` (optional), apply ``--set`` overrides, then ``direct`` keyword values."""
    return build_config(read_layers(path, overrides, **direct))
