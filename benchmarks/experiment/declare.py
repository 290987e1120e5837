"""What a benchmark script declares: its preset (arms and settings, from TOML) and its
:class:`Experiment` (how one spec is built, run, described and tabulated)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

Record = dict[str, Any]
PRESETS = Path(__file__).resolve().parent.parent / "presets"


@dataclass(frozen=True)
class Arm:
    """One method of a grid: the registered algorithm it runs and what it sets over the
    script's hyperparameters (``hyper``) and fleet (``fleet``)."""

    algorithm: str
    hyper: dict[str, Any] = field(default_factory=dict)
    fleet: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Preset:
    """A ``benchmarks/presets/<name>.toml`` file: ``[settings]`` (the command line's defaults,
    by argparse ``dest``), ``[arms.<method>]`` (in the file's order), ``[presets.<name>]``
    (settings that a named preset, ``--preset NAME``, puts over ``[settings]``) and any other
    tables the script reads (``other``; ``[report]``: what its tables compare)."""

    name: str
    settings: dict[str, Any]
    arms: dict[str, Arm]
    named: dict[str, dict[str, Any]]
    other: dict[str, Any]

    def pairs(self, key: str = "pairs") -> tuple[tuple[str, str], ...]:
        """``[report]``'s ``key`` as (a, b) pairs: the paired differences ``a - b`` a table
        shows."""
        return tuple((str(a), str(b)) for a, b in self.other["report"][key])


def load_preset(name: str, folder: Path = PRESETS) -> Preset:
    """Read ``folder/<name>.toml``."""
    doc = tomllib.loads((folder / f"{name}.toml").read_text())
    return Preset(
        name=name,
        settings=doc.pop("settings", {}),
        arms={method: Arm(**arm) for method, arm in doc.pop("arms", {}).items()},
        named=doc.pop("presets", {}),
        other=doc,
    )


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
    """

    description: str  # the script's docstring (--help shows its first paragraph)
    preset: Preset
    execute: Callable[[Record, argparse.Namespace], Record]
    describe: Callable[[Record], str]
    tables: Callable[[Results], str]
    spec: Callable[[argparse.Namespace, str, float, int], Record | None] | None = None
    plan: Callable[[argparse.Namespace], list[Record]] | None = None
    add_args: Callable[[argparse.ArgumentParser], None] | None = None
    finish_args: Callable[[argparse.Namespace], None] | None = None
    prepare: Callable[[argparse.Namespace], None] | None = None
    dirty: bool = False  # label runs ``-dirty`` when tracked files differ from HEAD
    jobs: bool = True  # the script has --jobs (else runs go in this process)
    deadline: float | None = 600.0  # --deadline's default; None: no such option
    code: bool = True  # the script has --code
