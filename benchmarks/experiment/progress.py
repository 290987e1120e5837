"""Where a resumable grid stands (``--progress``): each planned run done (in ``--out``), failed,
in progress (its folder in ``--work-dir``, read while another process trains it), or to do,
with how long the unfinished ones may take.

A run in progress ends when its best round is ``patience`` rounds old or at its cap, so the
time left is a range: from "no better round from now on" to "every round up to the cap".
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from harness import spec_key

from coordinator import accuracy
from coordinator.metrics_log import METRICS_FILE, load_metrics
from experiment.declare import Record

DONE, FAILED, RUNNING, TODO = "done", "failed", "in progress", "to do"


@dataclass(frozen=True)
class RunState:
    """One planned run's standing."""

    spec: Record
    state: str  # DONE, FAILED, RUNNING or TODO
    rounds: int = 0  # training rounds completed
    best: accuracy.RoundValue | None = None  # personalised, so far
    s_per_round: float | None = None  # median of the completed rounds
    left_rounds: tuple[int, int] | None = None  # (fewest, most) rounds still to run


def _label(spec: Record) -> str:
    alpha = spec.get("alpha")
    where = f" a={alpha:g}" if isinstance(alpha, (int, float)) else ""
    return f"{spec.get('method', spec.get('algorithm', '?'))}{where} seed={spec.get('seed')}"


def _in_progress(spec: Record, folder: Path) -> RunState:
    """The state of a run whose folder exists: its training rounds so far, the best, the
    median round time, and the rounds the stopping rule leaves it."""
    rounds = accuracy.training_rounds(load_metrics(folder).records)
    best = accuracy.best_round(rounds, accuracy.PERSONALISED)
    times = [float(r["duration_s"]) for r in rounds if isinstance(r.get("duration_s"), int | float)]
    done = max((r["round"] for r in rounds if isinstance(r.get("round"), int)), default=0)
    cap = spec.get("rounds")
    left = None
    if isinstance(cap, int):
        patience = spec.get("patience") or 0
        first_stop = min(cap, best.round + patience) if best and patience else cap
        left = (max(0, first_stop - done), max(0, cap - done))
    return RunState(
        spec,
        RUNNING,
        rounds=done,
        best=best,
        s_per_round=statistics.median(times) if times else None,
        left_rounds=left,
    )


def states(
    specs: Iterable[Record],
    runs: list[Record],
    failures: list[Record],
    folder: Callable[[Record], Path | None] | None = None,
) -> list[RunState]:
    """Each spec's standing, in plan order; ``folder(spec)`` is its run's folder in the work
    directory (None: the script keeps none, or no ``--work-dir``)."""
    done = {spec_key(r["spec"]) for r in runs}
    failed = {spec_key(f["spec"]) for f in failures}
    out = []
    for spec in specs:
        key = spec_key(spec)
        path = folder(spec) if folder is not None else None
        if key in done:
            out.append(RunState(spec, DONE))
        elif path is not None and (path / METRICS_FILE).is_file():
            out.append(_in_progress(spec, path))
        elif key in failed:
            out.append(RunState(spec, FAILED))
        else:
            out.append(RunState(spec, TODO))
    return out


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def table(items: list[RunState]) -> str:
    """A markdown table of the runs not done (the done ones counted), and a total."""
    lines = [
        "| run | state | round | best so far | s/round | time left |",
        "|---|---|---|---|---|---|",
    ]
    low = high = 0.0
    for item in items:
        if item.state == DONE:
            continue
        round_ = best = pace = left = "–"
        if item.state == RUNNING:
            cap = item.spec.get("rounds")
            round_ = f"{item.rounds}/{cap}" if cap else str(item.rounds)
            if item.best is not None:
                best = f"{100 * item.best.value:.2f} (r{item.best.round})"
            if item.s_per_round is not None:
                pace = f"{item.s_per_round:.1f}"
                if item.left_rounds is not None:
                    few, most = (n * item.s_per_round for n in item.left_rounds)
                    low, high = low + few, high + most
                    left = _hours(most) if few == most else f"{_hours(few)} to {_hours(most)}"
        lines.append(
            f"| {_label(item.spec)} | {item.state} | {round_} | {best} | {pace} | {left} |"
        )
    count = {s: sum(1 for i in items if i.state == s) for s in (DONE, RUNNING, TODO, FAILED)}
    summary = ", ".join(f"{n} {s}" for s, n in count.items() if n)
    span = _hours(high) if low == high else f"{_hours(low)} to {_hours(high)}"
    total = f"; the runs in progress need {span} more" if high else ""
    head = f"{len(items)} runs planned: {summary}{total}."
    return head if count[DONE] == len(items) else "\n".join([head, "", *lines])
