"""Where a resumable grid stands (``--progress``): each planned run done (in ``--out``), failed,
in progress (its folder in ``--work-dir``, read while another process trains it), or to do,
with how long the unfinished ones may take.

A run in progress ends when its best round is ``patience`` rounds old or at its cap, so the
time left is a range: from "no better round from now on" to "every round up to the cap". A run
to do is expected to take what the finished runs of its row (its settings, other seeds) took.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from harness import method_name, spec_key

from coordinator import accuracy
from coordinator.metrics_log import METRICS_FILE, as_int, load_metrics, number_at
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
    expected_s: float | None = None  # a run to do: its row's finished runs' median time


def _row(spec: Record) -> str:
    """A spec without its seed: the runs whose finished ones predict its time."""
    return spec_key({k: v for k, v in spec.items() if k != "seed"})


def _label(spec: Record) -> str:
    method = method_name(spec)
    alpha, data = spec.get("alpha"), spec.get("data")
    where = f" a={alpha:g}" if isinstance(alpha, (int, float)) else ""
    return f"{method}{f' {data}' if data else ''}{where} seed={spec.get('seed')}"


def _in_progress(spec: Record, folder: Path) -> RunState:
    """The state of a run whose folder exists: its training rounds so far, the best, the
    median round time, and the rounds the stopping rule leaves it (none yet before its first
    round closes)."""
    started = (folder / METRICS_FILE).is_file()
    rounds = accuracy.training_rounds(load_metrics(folder).records) if started else []
    best = accuracy.best_round(rounds, accuracy.PERSONALISED)
    times = [s for r in rounds if (s := number_at(r, "duration_s")) is not None]
    done = max((n for r in rounds if (n := as_int(r.get("round"))) is not None), default=0)
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


def _run_seconds(run: Record) -> float | None:
    """A finished run's training time: its rounds at its pace (a resumed run's ``wall_s``
    counts the resumed part only), else its wall time."""
    pace, rounds = number_at(run, "s_per_round"), as_int(run.get("rounds_done"))
    return pace * rounds if pace is not None and rounds is not None else number_at(run, "wall_s")


def _expected(spec: Record, runs: list[Record]) -> float | None:
    """The median training time of the finished runs of ``spec``'s row (every setting the
    same, another seed)."""
    same = [s for r in runs if _row(r["spec"]) == _row(spec) and (s := _run_seconds(r)) is not None]
    return statistics.median(same) if same else None


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
        elif path is not None and path.is_dir():
            out.append(_in_progress(spec, path))
        else:
            state = FAILED if key in failed else TODO
            out.append(RunState(spec, state, expected_s=_expected(spec, runs)))
    return out


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def table(items: list[RunState]) -> str:
    """A markdown table of the runs not done (the done ones counted), and a total."""
    lines = [
        "| run | state | round | best so far | s/round | time left |",
        "|---|---|---|---|---|---|",
    ]
    low = high = todo = 0.0
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
        elif item.expected_s is not None:
            todo += item.expected_s
            left = f"about {_hours(item.expected_s)}"
        lines.append(
            f"| {_label(item.spec)} | {item.state} | {round_} | {best} | {pace} | {left} |"
        )
    count = {s: sum(1 for i in items if i.state == s) for s in (DONE, RUNNING, TODO, FAILED)}
    summary = ", ".join(f"{n} {s}" for s, n in count.items() if n)
    span = _hours(high) if low == high else f"{_hours(low)} to {_hours(high)}"
    total = f"; the runs in progress need {span} more" if high else ""
    if todo:
        total += f"; the runs to do about {_hours(todo)} (as their rows' finished runs)"
    head = f"{len(items)} runs planned: {summary}{total}."
    return head if count[DONE] == len(items) else "\n".join([head, "", *lines])
