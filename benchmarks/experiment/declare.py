"""What a benchmark script declares: its preset (arms and settings, from TOML) and its
:class:`Experiment` (how one spec is built, run, described and tabulated)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from harness import SimRun

from coordinator.presets import Arm, Preset
from coordinator.presets import load_preset as read_preset

__all__ = ["Arm", "Experiment", "Preset", "Record", "Results", "load_preset"]

Record = dict[str, Any]


class Execute(Protocol):
    """Runs one spec (with ``--jobs``, in a worker process: a module-level function)."""

    def __call__(self, spec: Record, args: argparse.Namespace) -> Record: ...


class BuildRun(Protocol):
    """The simulation a spec runs, which names its resumable folder."""

    def __call__(self, spec: Record, args: argparse.Namespace) -> SimRun: ...


PRESETS = Path(__file__).resolve().parent.parent / "presets"


def load_preset(name: str, folder: Path = PRESETS) -> Preset:
    """Read ``folder/<name>.toml`` (``benchmarks/presets`` unless told otherwise)."""
    return read_preset(name, folder)


@dataclass(frozen=True)
class Results:
    """What the tables see: the parsed command line, the specs this call planned, and the
    runs and failures of the results file."""

    args: argparse.Namespace
    specs: list[Record]
    runs: list[Record]
    failures: list[Record]


@dataclass(frozen=True)
class Experiment:
    """A benchmark grid.

    The standard grid is ``--methods`` (the preset's arms) x ``--alphas`` x ``--seeds`` through
    ``spec(args, method, alpha, seed)`` (None leaves a cell out); ``plan(args)`` replaces it
    for another grid (and then ``--methods`` and ``--alphas`` are the script's own, from
    ``add_args``). ``execute(spec, args)`` runs one spec and returns its summary (a dict with
    ``spec``); with ``--jobs`` it runs in worker processes, so it is a module-level function.
    ``prepare(args)`` runs before anything is read (a split to export, files to merge).
    ``sim_run(spec, args)`` is the simulation ``execute`` runs, which names its resumable folder
    under ``--work-dir``: ``--progress`` reads a run in progress there.
    """

    description: str  # the script's docstring (--help shows its first paragraph)
    preset: Preset
    execute: Execute
    describe: Callable[[Record], str]
    tables: Callable[[Results], str]
    spec: Callable[[argparse.Namespace, str, float, int], Record | None] | None = None
    plan: Callable[[argparse.Namespace], list[Record]] | None = None
    add_args: Callable[[argparse.ArgumentParser], None] | None = None
    finish_args: Callable[[argparse.Namespace], None] | None = None
    prepare: Callable[[argparse.Namespace], None] | None = None
    sim_run: BuildRun | None = None
    dirty: bool = False  # label runs ``-dirty`` when tracked files differ from HEAD
    jobs: bool = True  # the script has --jobs (else runs go in this process)
    deadline: float | None = 600.0  # --deadline's default; None: no such option
    code: bool = True  # the script has --code
