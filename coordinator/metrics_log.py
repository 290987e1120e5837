"""A run's ``metrics.jsonl`` read into a :class:`MetricsLog`: one :class:`StepRow` a completed
step, for ``coordinator report`` (:mod:`coordinator.report`).

The coordinator appends one JSON object per completed step to ``RUN_DIR/metrics.jsonl``. The
reader is lenient: missing or null fields show as ``-``, and a line that is not a JSON object
(typically a last line cut short by a crash) is skipped and named in the report.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.errors import ConfigError

__all__ = [
    "CONFIG_FILE",
    "METRICS_FILE",
    "AgentPoint",
    "MetricsLog",
    "StepRow",
    "as_int",
    "load_metrics",
    "number_at",
]


METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "run.json"


@dataclass(frozen=True)
class AgentPoint:
    """One agent's numbers in one step."""

    acc_local: float | None
    acc_global: float | None
    arch: str


@dataclass(frozen=True)
class StepRow:
    """One completed step, with every field optional except where it came from."""

    line: int
    round: int | None
    phase: str
    participants: int
    mean_local: float | None
    std_local: float | None
    mean_global: float | None
    std_global: float | None
    bytes_step: int
    bytes_by_kind: dict[str, int]
    agents: dict[str, AgentPoint]


@dataclass(frozen=True)
class MetricsLog:
    """A parsed run directory.

    Attributes:
        run_dir: The directory read.
        steps: The steps in file order.
        skipped: ``(line number, reason)`` of every line that could not be used.
        config: The run configuration from ``run.json``, if present and readable.
        config_error: Why ``run.json`` could not be read, if it exists but is broken.
        records: The steps' records as read, for :mod:`coordinator.accuracy`'s summaries.
    """

    run_dir: Path
    steps: list[StepRow]
    skipped: list[tuple[int, str]] = field(default_factory=list)
    config: dict[str, Any] | None = None
    config_error: str | None = None
    records: list[dict[str, Any]] = field(default_factory=list)


def load_metrics(run_dir: str | Path) -> MetricsLog:
    """Parse ``RUN_DIR/metrics.jsonl`` (and ``RUN_DIR/run.json`` when present).

    Raises:
        ConfigError: ``RUN_DIR`` or its ``metrics.jsonl`` does not exist.
    """
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ConfigError(f"no {METRICS_FILE} in {run_dir} (is it a run directory?)")
    steps: list[StepRow] = []
    records: list[dict[str, Any]] = []
    skipped: list[tuple[int, str]] = []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            last = "truncated last line" if number == len(lines) else "invalid JSON"
            skipped.append((number, f"{last} ({exc.msg} at column {exc.colno})"))
            continue
        if not isinstance(record, dict):
            skipped.append((number, f"a JSON {type(record).__name__}, not an object"))
            continue
        steps.append(_step(number, record))
        records.append(record)
    config, config_error = _read_config(run_dir / CONFIG_FILE)
    return MetricsLog(run_dir, steps, skipped, config, config_error, records)


def _read_config(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    if not path.is_file():
        return None, None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"{path.name} unreadable: {exc}"
    if not isinstance(data, dict):
        return None, f"{path.name} holds a JSON {type(data).__name__}, not an object"
    return data, None


def number_at(obj: Mapping[str, Any], key: str) -> float | None:
    """``obj[key]`` as a float when it is a finite number (not a bool), else ``None``."""
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def as_int(value: object) -> int | None:
    """``value`` when it is an int (not a bool), else ``None``."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _step(line: int, rec: Mapping[str, Any]) -> StepRow:
    raw_agents = rec.get("agents")
    agents = {
        str(device): AgentPoint(
            number_at(info, "acc_local"),
            number_at(info, "acc_global"),
            str(info.get("arch") or "-"),
        )
        for device, info in (raw_agents.items() if isinstance(raw_agents, dict) else ())
        if isinstance(info, dict)
    }
    raw_bytes = rec.get("bytes")
    by_kind = {
        str(k): v
        for k, v in (raw_bytes.items() if isinstance(raw_bytes, dict) else ())
        if as_int(v) is not None
    }
    total = as_int(rec.get("bytes_total"))
    participants = rec.get("participants")
    local = _mean_std(rec, "acc_local", [a.acc_local for a in agents.values()])
    global_ = _mean_std(rec, "acc_global", [a.acc_global for a in agents.values()])
    return StepRow(
        line=line,
        round=as_int(rec.get("round")),
        phase=str(rec.get("phase") or "-"),
        participants=len(participants) if isinstance(participants, list) else len(agents),
        mean_local=local[0],
        std_local=local[1],
        mean_global=global_[0],
        std_global=global_[1],
        bytes_step=total if total is not None else sum(by_kind.values()),
        bytes_by_kind=by_kind,
        agents=agents,
    )


def _mean_std(
    rec: Mapping[str, Any], key: str, values: list[float | None]
) -> tuple[float | None, float | None]:
    """The recorded mean and std, or else those of the agents' values (population std)."""
    mean, std = number_at(rec, f"mean_{key}"), number_at(rec, f"std_{key}")
    present = [v for v in values if v is not None]
    if mean is None and present:
        mean = sum(present) / len(present)
    if std is None and present and mean is not None:
        std = math.sqrt(sum((v - mean) ** 2 for v in present) / len(present))
    return mean, std
