"""FedProto at reference strength: ours against HtFLlib's settings.

Setting (HtFLlib's defaults, ``docs/algorithms/baselines.md`` "HtFLlib preset"): MNIST-5k at 28x28,
20
clients, Dirichlet(alpha) label skew, plain SGD lr 0.01 without momentum, batch 10, 1 local
epoch, full participation, FedProto lambda 10 and prediction by the nearest global prototype.
The split is made once per alpha with ``--split-seed`` and written as a partition file
(``benchmarks/results/splits/``); every method and training seed runs on that same file through
``FleetSpec.partition_file``, so seeds vary the initialisation and batch order only.

Metric: personalised accuracy, each agent's accuracy on its own test split, weighted by the
split's size (= correct / total over all clients), at the ``final`` step (the last model with
the prototypes aggregated from its own round: HtFLlib's evaluation order) and, per round, as
reported after local training. ``best`` is the maximum of the per-round curve (HtFLlib prints
its maximum as "Best accuracy").

Usage::

    python benchmarks/fedproto_reference.py --alphas 0.1 1.0 --seeds 0 1 2 --rounds 100 \\
        --methods local fedproto --out benchmarks/results/fedproto_reference.json \\
        --md benchmarks/results/fedproto_reference.md

Settings, arms and compared pairs: ``benchmarks/presets/fedproto_reference.toml``. Results are
appended to ``--out`` after every run; a rerun skips runs already there, and a run that raised
is recorded under ``failures`` and retried by the next invocation.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import experiment
from experiment.summary import paired_rows, steps_failed
from harness import ROOT, ci_cell, mean_sd

logging.basicConfig(level=logging.ERROR)

PRESET = experiment.load_preset("fedproto_reference")
METHODS = PRESET.arms
SGD: dict[str, Any] = PRESET.other["sgd"]  # every arm's hyperparameters start here
PAIRS = PRESET.pairs()  # which pairs the tables difference (a - b)


def add_args(ap: argparse.ArgumentParser) -> None:
    """The script's own options (defaults: benchmarks/presets/fedproto_reference.toml)."""
    ap.add_argument("--split-seed", type=int, help="seed of the exported split")
    ap.add_argument("--data")
    ap.add_argument("--clients", type=int)
    ap.add_argument("--family", help="models.families name")
    ap.add_argument("--feature-dim", type=int)
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--test-fraction", type=float, help="HtFLlib: train ratio 0.75")
    ap.add_argument("--min-size", type=int, help="HtFLlib: batch / (1 - 0.75)")
    ap.add_argument(
        "--device", help="where the agents train (cpu, cuda); not part of a run's identity"
    )
    ap.add_argument("--tag", help="label kept in the spec (e.g. the code version)")
    ap.add_argument(
        "--probe",
        default=None,
        choices=["none", "architecture", "head"],
        help="instead of the grid: the global prototypes' geometry per round with this "
        "shared_init (first alpha, seed 0, --rounds rounds)",
    )


def split_path(args: argparse.Namespace, alpha: float) -> Path:
    """Where the split of ``alpha`` lives (made on first use with ``--split-seed``)."""
    name = f"{args.data}_dir{alpha:g}_k{args.clients}_seed{args.split_seed}.npz"
    return ROOT / "benchmarks/results/splits" / name


def ensure_split(args: argparse.Namespace, alpha: float) -> Path:
    """Export the seeded split once (the same code as ``coordinator partition``)."""
    path = split_path(args, alpha)
    if path.is_file():
        return path
    from edge_agent.data import (
        PartitionSpec,
        load_dataset,
        make_federated_split,
        save_partition_file,
    )

    spec = PartitionSpec(
        scheme="dirichlet",
        alpha=alpha,
        num_clients=args.clients,
        seed=args.split_seed,
        min_size=args.min_size,
        test_fraction=args.test_fraction,
        global_test_size=0,
    )
    return save_partition_file(path, make_federated_split(load_dataset(args.data), spec))


def prepare(args: argparse.Namespace) -> None:
    """Export the splits the grid runs on (once, before its runs start in parallel)."""
    if not args.table_only:
        for alpha in args.alphas:
            ensure_split(args, alpha)


def run_spec(args: argparse.Namespace, method: str, alpha: float, seed: int) -> dict[str, Any]:
    """Everything that determines one run (also its identity in the results file)."""
    arm = METHODS[method]
    fleet = dict(arm.fleet)
    if fleet.pop("native_features", False):  # the trunk's own features, no projection
        fleet["feature_dim"] = None
    return {
        "method": method,
        "algorithm": arm.algorithm,
        "hyper": {**SGD, **arm.hyper},
        "fleet": fleet,
        "data": args.data,
        "family": args.family,
        "feature_dim": args.feature_dim,
        "alpha": alpha,
        "seed": seed,
        "split": str(split_path(args, alpha).relative_to(ROOT)),
        "clients": args.clients,
        "rounds": args.rounds,
        "tag": args.tag,
    }


def execute(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One simulation on the split file, reduced to its accuracies."""
    from coordinator.config import load_config
    from coordinator.sim.simulate import FleetSpec, simulate
    from edge_agent.data import load_partition_file
    from models.cpu_threads import limit_cpu_threads
    from models.families import family_models

    limit_cpu_threads(args.threads)
    split = ROOT / spec["split"]
    sizes = [len(t) for t in load_partition_file(split).test]
    run_dir = Path(tempfile.mkdtemp(prefix="fedproto-ref-"))
    try:
        cfg = load_config(
            None,
            [],
            algorithm=spec["algorithm"],
            rounds=spec["rounds"],
            run_dir=str(run_dir),
            min_agents=spec["clients"],
            seed=spec["seed"],
            deadline_s=args.deadline,
            max_retries=1,
            run_id="fedproto-ref",
        ).replace(hyper=spec["hyper"])
        cfg.algorithm_config()
        fleet = FleetSpec(
            num_agents=spec["clients"],
            models=tuple(family_models(spec["family"], spec["clients"])),
            data=spec["data"],
            partition_file=str(split),
            global_test_size=0,
            device=args.device,
            **{"feature_dim": spec["feature_dim"], **spec["fleet"]},
        )
        t0 = time.time()
        result = simulate(cfg, fleet)
        wall = time.time() - t0
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"spec": spec, "wall_s": wall, "device": args.device, **summarize(result.metrics, sizes)}


def _weighted(agents: dict[str, Any], sizes: list[int], key: str = "acc_local") -> float | None:
    """Sample-weighted accuracy over the agents that reported (agentK has sizes[K])."""
    num = den = 0.0
    for dev, a in agents.items():
        acc = a.get(key)
        if isinstance(acc, (int, float)) and math.isfinite(acc):
            n = sizes[int(dev.removeprefix("agent"))]
            num, den = num + acc * n, den + n
    return num / den if den else None


def summarize(steps: list[dict[str, Any]], sizes: list[int]) -> dict[str, Any]:
    """Final and per-round personalised accuracy."""
    final = [s for s in steps if s["phase"] == "final"]
    train = [s for s in steps if s["phase"] == "train"]
    curve = [_weighted(s["agents"], sizes) for s in train]
    vals = [c for c in curve if c is not None]
    acc = _weighted(final[-1]["agents"], sizes) if final else None
    # HtFLlib's order: round t's task evaluates round t-1's model with the fresh prototypes
    # (acc_local_received); the final step is the last model's
    received = [_weighted(s["agents"], sizes, "acc_local_received") for s in train[1:]] + [acc]
    got = [c for c in received if c is not None]
    return {
        "acc": acc,
        "last_round": vals[-1] if vals else None,
        "best": max(vals) if vals else None,
        "best_received": max(got) if len(got) > 1 else None,
        "curve": curve,
        "curve_received": received,
        "steps_failed": steps_failed(steps),
    }


# ----- prototype geometry -----------------------------------------------------------------------
def probe(args: argparse.Namespace, alpha: float, shared_init: str) -> list[dict[str, float]]:
    """Per round, the global prototypes' geometry: mean norm, smallest and mean distance between
    two classes, and the mean distance of the clients' prototypes to their class's global one
    (the aggregation is wrapped in this process only; the run is ``fedproto`` seed 0)."""
    import numpy as np

    from coordinator.config import load_config
    from coordinator.sim.simulate import FleetSpec, simulate
    from coordinator.strategies.fedproto import FedProtoStrategy
    from models.cpu_threads import limit_cpu_threads
    from models.families import family_models

    limit_cpu_threads(args.threads)
    rows: list[dict[str, float]] = []
    original = FedProtoStrategy.fold_prototypes

    def aggregate(self: FedProtoStrategy, step: Any, replies: list[Any]) -> dict[str, float]:
        out = original(self, step, replies)
        assert self.protos is not None
        table = dict(zip(self.protos.class_ids.tolist(), self.protos.vectors, strict=True))
        p = np.stack(list(table.values()))
        gaps = np.linalg.norm(p[:, None] - p[None], axis=2)[~np.eye(len(p), dtype=bool)]
        sets = [r.payloads["protos"] for _, r in replies]
        spread = [
            float(np.linalg.norm(v - table[c]))
            for u in sets
            for c, v in zip(u.class_ids.tolist(), u.vectors, strict=True)
        ]
        rows.append(
            {
                "round": step.round,
                "norm": float(np.linalg.norm(p, axis=1).mean()),
                "min_gap": float(gaps.min()),
                "mean_gap": float(gaps.mean()),
                "client_spread": float(np.mean(spread)),
            }
        )
        print(rows[-1], flush=True)
        return out

    FedProtoStrategy.fold_prototypes = aggregate  # type: ignore[method-assign]
    hyper = {**SGD, **METHODS["fedproto"].hyper}
    run_dir = Path(tempfile.mkdtemp(prefix="fedproto-probe-"))
    try:
        cfg = load_config(
            None, [], algorithm="fedproto", rounds=args.rounds, run_dir=str(run_dir),
            min_agents=args.clients, seed=0, run_id="fedproto-probe",
        ).replace(hyper={**hyper, "shared_init": shared_init})  # fmt: skip
        fleet = FleetSpec(
            num_agents=args.clients,
            models=tuple(family_models(args.family, args.clients)),
            data=args.data,
            feature_dim=args.feature_dim,
            partition_file=str(ensure_split(args, alpha)),
            global_test_size=0,
        )
        simulate(cfg, fleet)
    finally:
        FedProtoStrategy.fold_prototypes = original  # type: ignore[method-assign]
        shutil.rmtree(run_dir, ignore_errors=True)
    return rows


# ----- tables ---------------------------------------------------------------------------------
_ms = functools.partial(mean_sd, digits=2)
_ci = functools.partial(ci_cell, digits=2)


def tables(results: experiment.Results) -> str:
    """Markdown: one block per (alpha, rounds, tag): accuracy table and paired differences."""
    groups: dict[tuple[float, int, str], dict[str, dict[int, dict[str, Any]]]] = {}
    for r in results.runs:
        s = r["spec"]
        key = (s["alpha"], s["rounds"], s.get("tag", ""))
        groups.setdefault(key, {}).setdefault(s["method"], {})[s["seed"]] = r
    out: list[str] = []
    for (alpha, rounds, tag), by in sorted(groups.items()):
        out += [
            f"### Dir({alpha:g}), {rounds} rounds{f', {tag}' if tag else ''}",
            "",
            "Personalised accuracy, % (mean ± sd over seeds): final = the `final` step (the "
            "last model with the prototypes of its own round); last = the last round as "
            "reported after training; best = the best round; best, HtFLlib order = the best "
            "of each model evaluated with the prototypes built from it (`acc_local_received`, "
            "HtFLlib's 'Best accuracy').",
            "",
            "| method | seeds | final | last round | best round | best, HtFLlib order |",
            "|---|---|---|---|---|---|",
        ]
        for m in (m for m in METHODS if m in by):
            rs = list(by[m].values())
            out.append(
                f"| {m} | {len(rs)} | {_ms([r['acc'] for r in rs])} | "
                f"{_ms([r['last_round'] for r in rs])} | {_ms([r['best'] for r in rs])} | "
                f"{_ms([r.get('best_received') for r in rs])} |"
            )
        methods = {m: list(seeds.values()) for m, seeds in by.items()}
        rows = paired_rows(methods, PAIRS, ("acc", "best"), _ci)
        if rows:
            out += [
                "",
                "Paired difference, points (mean [95% t interval]), same seed = same split, init "
                "and batch order:",
                "",
                "| comparison | seeds | final | best round |",
                "|---|---|---|---|",
                *rows,
            ]
        out.append("")
    return "\n".join(out)


def _describe(r: dict[str, Any]) -> str:
    return f"final {100 * r['acc']:.2f} best {100 * r['best']:.2f} ({r['wall_s']:.0f} s)"


EXPERIMENT = experiment.Experiment(
    description=__doc__ or "",
    preset=PRESET,
    spec=run_spec,
    execute=execute,
    describe=_describe,
    tables=tables,
    add_args=add_args,
    prepare=prepare,
)


def main(argv: list[str] | None = None) -> None:
    """Run the missing runs, then print (and optionally write) the tables; or, with
    ``--probe``, the prototype geometry of one run."""
    args = experiment.parse_args(EXPERIMENT, argv)
    if args.probe is not None:
        probe(args, args.alphas[0], args.probe)
        return
    experiment.run(EXPERIMENT, args)


if __name__ == "__main__":
    main()
