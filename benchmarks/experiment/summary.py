"""Reductions of a run's step records and table rows that several benchmark grids share."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from typing import Any

from harness import by_seed, group_by, mean_of, paired_diffs

from coordinator import accuracy

Record = dict[str, Any]


# ----- step records ---------------------------------------------------------------------------
def steps_failed(steps: list[Record]) -> int:
    """Steps the coordinator recorded as failed (missed their quorum)."""
    return sum(1 for s in steps if s.get("status") == "failed")


def round_means(train: Iterable[Record], key: str) -> list[float]:
    """The training rounds' values of ``key`` (:func:`coordinator.accuracy.round_value`: the
    recorded ``mean_<key>``, or the personalised ``acc_local_weighted``), where present."""
    return [p.value for p in accuracy.round_values(train, key)]


def best_round(train: Iterable[Record], key: str) -> float | None:
    """The best round's value of ``key`` (optimistic, as the papers report it); the same
    reduction as ``coordinator report``'s best round."""
    best = accuracy.best_round(train, key)
    return None if best is None else best.value


def late_mean(train: Iterable[Record], key: str, first_round: float) -> float | None:
    """The mean of ``key``'s round values over rounds ``first_round``.. (e.g. the second half)."""
    vals = [p.value for p in accuracy.round_values(train, key) if p.round >= first_round]
    return statistics.fmean(vals) if vals else None


def per_arch(agents: Iterable[Record], keys: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Means of ``keys`` over the agents of each architecture (``arch``), sorted by name."""
    groups = group_by(agents, lambda a: str(a.get("arch")))
    return {arch: {k: mean_of(g, k) for k in keys} for arch, g in sorted(groups.items())}


def bytes_by_kind(steps: Iterable[Record]) -> dict[str, int]:
    """Every step's byte counters summed by kind (``tx.task``, ``rx.reply``, ...)."""
    out: dict[str, int] = {}
    for s in steps:
        for k, v in s["bytes"].items():
            out[k] = out.get(k, 0) + int(v)
    return out


def bytes_by_phase(
    steps: Iterable[Record], phase: Callable[[Record], str] = lambda s: str(s["phase"])
) -> dict[str, dict[str, int]]:
    """:func:`bytes_by_kind` per ``phase(step)`` (default: the step's phase)."""
    return {name: bytes_by_kind(g) for name, g in group_by(steps, phase).items()}


# ----- tables ---------------------------------------------------------------------------------
def by_method(runs: Iterable[Record]) -> dict[str, list[Record]]:
    """Runs grouped by their spec's method, in first-seen order."""
    return group_by(runs, lambda r: r["spec"]["method"])


def paired_rows(
    groups: dict[str, list[Record]],
    pairs: Iterable[tuple[str, str]],
    keys: tuple[str, ...],
    cell: Callable[[list[float]], str],
    wins: str | None = None,
) -> list[str]:
    """``| a − b | seeds | cell(diffs of each key) ... |`` per pair with seeds in common (same
    seed = same partition, inits and test sets), and ``| wins/seeds |`` (the seeds where
    ``a - b`` of ``wins`` is above 0) when ``wins`` is given."""
    rows = []
    for a, b in pairs:
        if a not in groups or b not in groups:
            continue
        seeds = len(set(by_seed(groups[a])) & set(by_seed(groups[b])))
        if not seeds:
            continue
        cols = [cell(paired_diffs(groups[a], groups[b], key)) for key in keys]
        if wins is not None:
            won = sum(1 for x in paired_diffs(groups[a], groups[b], wins) if x > 0)
            cols.append(f"{won}/{seeds}")
        rows.append(f"| {a} − {b} | {seeds} | " + " | ".join(cols) + " |")
    return rows
