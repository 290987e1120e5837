"""One line of ``metrics.jsonl`` per step: per-agent metrics, aggregates, bytes, accuracy means."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coordinator.strategies import AgentInfo, Step
from protocol.contract.messages import Reply

__all__ = ["REFUSED", "append_line", "step_record"]

REFUSED = "refused."  # prefix of the traffic keys of refused bytes (an ingest worker's too)


def step_record(  # noqa: PLR0917 - one record's parts, in order
    step: Step,
    participants: list[str],
    failed: dict[str, str],
    ordered: list[tuple[AgentInfo, Reply]],
    agg: dict[str, float],
    started: float,
    closed: float,
    traffic: dict[str, int],
) -> dict[str, Any]:
    """The record of one closed step, opened at ``started`` and closed at ``closed`` (on the
    engine's clock); ``traffic`` is the step's bytes per message kind."""
    agents = {
        a.device_id: {
            "acc_local": r.metrics.get("acc_local"),
            "acc_global": r.metrics.get("acc_global"),
            "loss": r.metrics.get("train_loss"),
            "num_samples": r.num_samples,
            "arch": a.register.arch,
            **dict(r.metrics),
        }
        for a, r in ordered
    }
    record: dict[str, Any] = {
        "round": step.round,
        "phase": step.phase,
        "time": closed,
        "duration_s": closed - started,
        "participants": participants,
        "quorum_met": True,
        "failed": failed,
        "agents": agents,
        "aggregate": agg,
        "bytes": traffic,
        "bytes_total": sum(traffic.values()),
    }
    for key in ("acc_local", "acc_global"):
        vals = [float(x) for v in agents.values() if isinstance(x := v[key], (int, float))]
        mean = sum(vals) / len(vals) if vals else None
        std = (sum((x - mean) ** 2 for x in vals) / len(vals)) ** 0.5 if mean is not None else None
        record[f"mean_{key}"], record[f"std_{key}"] = mean, std
    return record


def append_line(path: Path, record_json: str) -> None:
    """Append one record, already JSON (the directory is created on first use)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(record_json + "\n")
