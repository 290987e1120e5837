"""FedProto at reference strength (issue 20 §2): ours against HtFLlib's settings.

Setting (HtFLlib's defaults, ``docs/baselines.md`` "HtFLlib preset"): MNIST-5k at 28x28, 20
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

Results are appended to ``--out`` after every run; a rerun skips runs already there.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

logging.basicConfig(level=logging.ERROR)

ROOT = Path(__file__).resolve().parent.parent
# HtFLlib's client optimiser (clientbase: SGD without momentum), batch 10, one epoch
_SGD = {"lr": 0.01, "momentum": 0.0, "batch_size": 10, "local_epochs": 1, "optimizer": "sgd"}
_PROTO = {"proto_weight": 10.0, "predict": "prototype"}
_LOADER = {"batch_order": "fixed", "drop_last": True}
# method -> (algorithm, hyper overrides, fleet overrides)
METHODS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "local": ("local", {}, {}),
    "local_relu": ("local", {}, {"feature_act": "relu"}),
    "fedproto": ("fedproto", _PROTO, {}),  # the product's default start (shared_init = head)
    # the start (issue 20 §2): none = each agent its own (before the fix); architecture =
    # HtFLlib's (one start per architecture); head = that plus one head for the whole fleet
    "fedproto_noshare": ("fedproto", {**_PROTO, "shared_init": "none"}, {}),
    "fedproto_arch": ("fedproto", {**_PROTO, "shared_init": "architecture"}, {}),
    "fedproto_headinit": ("fedproto", {**_PROTO, "shared_init": "head"}, {}),
    "fedproto_relu": ("fedproto", _PROTO, {"feature_act": "relu"}),
    "fedproto_head": ("fedproto", {**_PROTO, "predict": "head"}, {}),
    # prototypes averaged over the features the local epoch computed (HtFLlib's clientproto)
    "fedproto_tp": ("fedproto", {**_PROTO, "proto_source": "training"}, {}),
    "fedproto_relu_tp": (
        "fedproto",
        {**_PROTO, "proto_source": "training"},
        {"feature_act": "relu"},
    ),
    # HtFLlib's loader: one fixed order (unshuffled over a split shuffled once), last partial
    # batch dropped (clientbase.load_train_data)
    "local_loader": ("local", _LOADER, {}),
    "fedproto_loader": ("fedproto", {**_PROTO, **_LOADER}, {}),
    # diagnosis: HtFLlib's feature size (512) and a lambda scaled to our 64
    "local_d512": ("local", {}, {"feature_dim": 512}),
    "fedproto_d512": ("fedproto", _PROTO, {"feature_dim": 512}),
    "fedproto_lam1": ("fedproto", {**_PROTO, "proto_weight": 1.25}, {}),
    "fedproto_l0_head": ("fedproto", {"proto_weight": 0.0, "predict": "head"}, {}),
    "fedproto_l0": ("fedproto", {**_PROTO, "proto_weight": 0.0}, {}),
    "fedproto_d512_head": ("fedproto", {**_PROTO, "predict": "head"}, {"feature_dim": 512}),
    # the trunk's own features, no projection: with --family homo_cnn4 (HtFLlib's FedAvgCNN)
    # or homo_cnn2 (its padded variant), 512-d non-negative features as in HtFLlib
    "local_native": ("local", {}, {"feature_dim": None}),
    "fedproto_native": ("fedproto", _PROTO, {"feature_dim": None}),
}
# which pairs the tables difference (a - b)
PAIRS = (
    ("fedproto", "local"),
    ("fedproto_noshare", "local"),
    ("fedproto_arch", "local"),
    ("fedproto_headinit", "local"),
    ("fedproto", "fedproto_noshare"),
    ("fedproto_relu", "local_relu"),
    ("fedproto_relu", "local"),
    ("fedproto_tp", "local"),
    ("fedproto_tp", "fedproto"),
    ("fedproto_relu_tp", "local_relu"),
    ("fedproto_head", "local"),
    ("fedproto_loader", "local_loader"),
    ("local_loader", "local"),
    ("fedproto_d512", "local_d512"),
    ("fedproto_native", "local_native"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["local", "fedproto"], choices=sorted(METHODS))
    ap.add_argument("--alphas", nargs="+", type=float, default=[0.1, 1.0])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="training seeds")
    ap.add_argument("--split-seed", type=int, default=1, help="seed of the exported split")
    ap.add_argument("--data", default="mnist5k")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--family", default="tiny", help="models.families name")
    ap.add_argument("--feature-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--test-fraction", type=float, default=0.25, help="HtFLlib: train ratio 0.75")
    ap.add_argument("--min-size", type=int, default=40, help="HtFLlib: batch / (1 - 0.75)")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (processes)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument(
        "--device",
        default="cpu",
        help="where the agents train (cpu, cuda); not part of a run's identity",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/fedproto_reference.json")
    ap.add_argument("--md", type=Path, default=None, help="write the markdown tables here")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--tag", default="", help="label kept in the spec (e.g. the code version)")
    ap.add_argument(
        "--probe",
        default=None,
        choices=["none", "architecture", "head"],
        help="instead of the grid: the global prototypes' geometry per round with this "
        "shared_init (first alpha, seed 0, --rounds rounds)",
    )
    return ap.parse_args(argv)


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


def run_spec(args: argparse.Namespace, method: str, alpha: float, seed: int) -> dict[str, Any]:
    """Everything that determines one run (also its identity in the results file)."""
    algorithm, hyper, fleet = METHODS[method]
    return {
        "method": method,
        "algorithm": algorithm,
        "hyper": {**_SGD, **hyper},
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


def execute(spec: dict[str, Any], threads: int, device: str = "cpu") -> dict[str, Any]:
    """One simulation, reduced to its accuracies (or the error)."""
    try:
        return _execute(spec, threads, device)
    except BaseException as exc:
        return {"spec": spec, "error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}


def _execute(spec: dict[str, Any], threads: int, device: str = "cpu") -> dict[str, Any]:
    import torch

    from coordinator.config import load_config
    from coordinator.sim.simulate import FleetSpec, simulate
    from edge_agent.data import load_partition_file
    from models.families import family_models

    torch.set_num_threads(threads)
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
            deadline_s=600.0,
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
            device=device,
            **{"feature_dim": spec["feature_dim"], **spec["fleet"]},
        )
        t0 = time.time()
        result = simulate(cfg, fleet)
        wall = time.time() - t0
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"spec": spec, "wall_s": wall, "device": device, **summarize(result.metrics, sizes)}


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
        "steps_failed": sum(1 for s in steps if s.get("status") == "failed"),
    }


# ----- prototype geometry -----------------------------------------------------------------------
def probe(args: argparse.Namespace, alpha: float, shared_init: str) -> list[dict[str, float]]:
    """Per round, the global prototypes' geometry: mean norm, smallest and mean distance between
    two classes, and the mean distance of the clients' prototypes to their class's global one
    (the aggregation is wrapped in this process only; the run is ``fedproto`` seed 0)."""
    import numpy as np
    import torch

    from coordinator.config import load_config
    from coordinator.sim.simulate import FleetSpec, simulate
    from coordinator.strategies.baselines import FedProtoStrategy
    from models.families import family_models

    torch.set_num_threads(args.threads)
    rows: list[dict[str, float]] = []
    original = FedProtoStrategy.aggregate

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

    FedProtoStrategy.aggregate = aggregate  # type: ignore[method-assign]
    run_dir = Path(tempfile.mkdtemp(prefix="fedproto-probe-"))
    try:
        cfg = load_config(
            None, [], algorithm="fedproto", rounds=args.rounds, run_dir=str(run_dir),
            min_agents=args.clients, seed=0, run_id="fedproto-probe",
        ).replace(hyper={**_SGD, **_PROTO, "shared_init": shared_init})  # fmt: skip
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
        FedProtoStrategy.aggregate = original  # type: ignore[method-assign]
        shutil.rmtree(run_dir, ignore_errors=True)
    return rows


# ----- results and tables ---------------------------------------------------------------------
def load(path: Path) -> list[dict[str, Any]]:
    """Runs already in ``path``."""
    return json.loads(path.read_text())["runs"] if path.is_file() else []


def save(path: Path, runs: list[dict[str, Any]]) -> None:
    """Write all runs with the commands that produced them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    commands = json.loads(path.read_text()).get("commands", []) if path.is_file() else []
    cmd = "python " + " ".join(sys.argv)
    if cmd not in commands:
        commands.append(cmd)
    path.write_text(json.dumps({"commands": commands, "runs": runs}, indent=1) + "\n")


# two-sided 95% t quantiles by degrees of freedom
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def _ms(xs: list[float]) -> str:
    if not xs:
        return "-"
    sd = statistics.stdev(xs) * 100 if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs) * 100:.2f} ± {sd:.2f}"


def _ci(d: list[float]) -> str:
    if len(d) < 2:
        return f"{d[0] * 100:+.2f}" if d else "-"
    m, sd = statistics.fmean(d) * 100, statistics.stdev(d) * 100
    h = _T95.get(len(d) - 1, 1.96) * sd / math.sqrt(len(d))
    return f"{m:+.2f} [{m - h:+.2f}, {m + h:+.2f}]"


def tables(runs: list[dict[str, Any]]) -> str:
    """Markdown: one block per (alpha, rounds, tag): accuracy table and paired differences."""
    groups: dict[tuple[float, int, str], dict[str, dict[int, dict[str, Any]]]] = {}
    for r in runs:
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
            rec = [r.get("best_received") for r in rs]
            out.append(
                f"| {m} | {len(rs)} | {_ms([r['acc'] for r in rs])} | "
                f"{_ms([r['last_round'] for r in rs])} | {_ms([r['best'] for r in rs])} | "
                f"{_ms([x for x in rec if x is not None])} |"
            )
        rows = []
        for a, b in PAIRS:
            if a in by and b in by:
                seeds = sorted(set(by[a]) & set(by[b]))
                d = {k: [by[a][s][k] - by[b][s][k] for s in seeds] for k in ("acc", "best")}
                rows.append(f"| {a} − {b} | {len(seeds)} | {_ci(d['acc'])} | {_ci(d['best'])} |")
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


def main(argv: list[str] | None = None) -> None:
    """Run the missing runs, then print (and optionally write) the tables."""
    args = parse_args(argv)
    if args.probe is not None:
        probe(args, args.alphas[0], args.probe)
        return
    runs = load(args.out)
    if not args.table_only:
        for alpha in args.alphas:
            ensure_split(args, alpha)
        done = {json.dumps(r["spec"], sort_keys=True) for r in runs}
        todo = [
            spec
            for alpha in args.alphas
            for seed in args.seeds
            for m in args.methods
            if json.dumps(spec := run_spec(args, m, alpha, seed), sort_keys=True) not in done
        ]
        print(f"{len(todo)} runs to do, {len(runs)} in {args.out}", flush=True)
        t0 = time.time()
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(execute, s, args.threads, args.device) for s in todo]
            for fut in as_completed(futures):
                r = fut.result()
                s = r["spec"]
                if "error" in r:
                    print(f"FAILED {s['method']} a={s['alpha']:g} seed {s['seed']}: {r['error']}")
                    print(r["tb"], file=sys.stderr)
                    continue
                runs.append(r)
                save(args.out, runs)
                print(
                    f"[{time.time() - t0:6.0f}s] {s['method']:14s} a={s['alpha']:g} "
                    f"seed {s['seed']}: final {100 * r['acc']:.2f} best {100 * r['best']:.2f} "
                    f"({r['wall_s']:.0f} s)",
                    flush=True,
                )
    text = tables(runs)
    print(text)
    if args.md is not None:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(text)


if __name__ == "__main__":
    main()
