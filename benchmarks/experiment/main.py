"""The one main of every benchmark grid: options, grid, resumable runs, progress, tables."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import (
    add_grid_args,
    code_label,
    failure_line,
    load_results,
    run_folder,
    run_grid,
    write_markdown,
)

from experiment import progress
from experiment.declare import Experiment, Record, Results


def parse_args(experiment: Experiment, argv: list[str] | None = None) -> argparse.Namespace:
    """The common options (``--preset``, ``--seeds``, the grid's ``--jobs``/``--threads``/
    ``--deadline``/``--code``/``--out``/``--md``/``--table-only``, and for the standard grid
    ``--methods`` and ``--alphas``) and the script's own, with the preset's settings as
    defaults (a named ``--preset`` over ``[settings]``, the command line over both)."""
    preset = experiment.preset
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--preset", choices=sorted(preset.named), default=None)
    chosen = first.parse_known_args(argv)[0].preset

    ap = argparse.ArgumentParser(
        description=experiment.description.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument(
        "--preset",
        choices=sorted(preset.named),
        default=None,
        help=f"named settings of benchmarks/presets/{preset.name}.toml",
    )
    if experiment.plan is None:
        arms = sorted(preset.arms)
        ap.add_argument("--methods", nargs="+", default=list(preset.arms), choices=arms)
        ap.add_argument("--alphas", nargs="+", type=float, help="Dirichlet alpha")
    ap.add_argument("--seeds", nargs="+", type=int)
    if experiment.add_args is not None:
        experiment.add_args(ap)
    add_grid_args(
        ap, None, jobs=experiment.jobs, deadline=experiment.deadline, code=experiment.code
    )
    settings = {**preset.settings, **(preset.named[chosen] if chosen else {})}
    unknown = sorted(set(settings) - {a.dest for a in ap._actions})
    if unknown:
        raise ValueError(f"benchmarks/presets/{preset.name}.toml: no option for {unknown}")
    ap.set_defaults(**settings)
    args = ap.parse_args(argv)
    if experiment.finish_args is not None:
        experiment.finish_args(args)
    return args


def plan(experiment: Experiment, args: argparse.Namespace) -> list[Record]:
    """The specs of this call, in the order they run: ``experiment.plan``'s, else every alpha,
    seed and method (that order) that ``experiment.spec`` keeps."""
    if experiment.plan is not None:
        return experiment.plan(args)
    assert experiment.spec is not None, "an Experiment needs spec or plan"
    cells = (
        experiment.spec(args, method, alpha, seed)
        for alpha in args.alphas
        for seed in args.seeds
        for method in args.methods
    )
    return [s for s in cells if s is not None]


def run(experiment: Experiment, args: argparse.Namespace) -> Results:
    """Unless ``--table-only``, run the planned specs ``--out`` lacks (resumable, saved after
    every run, ``--jobs`` processes where the script has the option); then print the tables,
    the failures, and write the tables to ``--md``. With ``--progress``, only print where each
    planned run stands."""
    if experiment.prepare is not None:
        experiment.prepare(args)
    specs = plan(experiment, args)
    runs, failures = load_results(args.out)
    if args.progress:
        print(progress.table(progress.states(specs, runs, failures, folder_of(experiment, args))))
        return Results(args, specs, runs, failures)
    if not args.table_only:
        runs, failures = run_grid(
            args.out,
            specs,
            functools.partial(experiment.execute, args=args),
            describe=experiment.describe,
            jobs=getattr(args, "jobs", 0),
            code=getattr(args, "code", None) or code_label(dirty=experiment.dirty),
        )
    results = Results(args, specs, runs, failures)
    text = experiment.tables(results)
    print(text)
    if failures:
        print(failure_line(args.out, failures))
    write_markdown(args.md, text)
    return results


def folder_of(
    experiment: Experiment, args: argparse.Namespace
) -> Callable[[Record], Path | None] | None:
    """Where a spec's run keeps its resumable folder (None: no ``--work-dir``, or the script
    declares no ``sim_run``)."""
    build, work_dir = experiment.sim_run, args.work_dir
    if build is None or work_dir is None:
        return None
    return lambda spec: run_folder(build(spec, args), work_dir)


def main(experiment: Experiment, argv: list[str] | None = None) -> Any:
    """Parse the command line and :func:`run` the experiment."""
    return run(experiment, parse_args(experiment, argv))
