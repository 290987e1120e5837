"""Synchronous against buffered rounds on a fleet with slow and flaky devices.

Setting: ``--agents`` simulated devices on ``--data`` (Dirichlet 0.5 label skew, full
participation), under a device profile (``coordinator/sim/profile.py``) in which
``--slow-share`` of the devices compute ``--slow-factor`` times slower and every device's reply
to a task is lost with probability ``--dropout`` (each round, slow or not). Per algorithm the
same fleet runs ``run.mode = "sync"`` (``--rounds`` rounds, each waiting for every reply or the
adaptive deadline) and ``run.mode = "buffered"`` (``--buffer-size`` replies a global version,
stale replies weighted by the polynomial staleness weight, ``--buffered-rounds`` versions:
by default about as many replies in all as the synchronous run's). Algorithms: FedAvg on one
architecture (``homo_mlp``), FedProto and Felo on the heterogeneous ``tiny`` family.

Recorded per run: each training step's wall-clock time since the first step's dispatch, the
agents' mean global and local accuracy after it and its bytes (the coordinator's endpoint
counters, progress messages included); the final step's accuracies. The markdown table compares
the two modes of each algorithm at a common time budget (the shorter run's training time):
the global accuracy of the last step closed by then. The waiting is real, so runs take as long
as the profile makes them. Results: ``benchmarks/results/async_fleet.json`` (appended after
each run, resumed on rerun), table ``benchmarks/results/async_fleet.md``.

Usage::

    python benchmarks/async_fleet.py --agents 10 --rounds 20
    python benchmarks/async_fleet.py --agents 5 --rounds 2 --algorithms felo   # a smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # sibling
    SimRun,
    add_grid_args,
    ci_cell,
    code_label,
    load_results,
    run_grid,
    spec_key,
    train_steps,
    write_markdown,
)

Record = dict[str, Any]
FAMILIES = {"fedavg": "homo_mlp", "fedproto": "tiny", "felo": "tiny"}
MODES = ("sync", "buffered")


def profile_doc(args: argparse.Namespace) -> Record:
    """The fleet's device profile as the spec records it (the profile file's tables)."""
    return {
        "seed": args.seed,
        "group": [{"share": args.slow_share, "speed": args.slow_factor, "dropout": args.dropout}],
        "default": {"dropout": args.dropout},
    }


def specs(args: argparse.Namespace) -> list[Record]:
    """One spec per algorithm and mode."""
    buffer_size = args.buffer_size or max(1, args.agents // 2)
    buffered_rounds = args.buffered_rounds or math.ceil(args.rounds * args.agents / buffer_size)
    out = []
    for algorithm in args.algorithms.split(","):
        for mode in MODES:
            out.append(
                {
                    "algorithm": algorithm,
                    "family": FAMILIES.get(algorithm, "tiny"),
                    "mode": mode,
                    "rounds": args.rounds if mode == "sync" else buffered_rounds,
                    "buffer_size": buffer_size if mode == "buffered" else 0,
                    "max_staleness": args.max_staleness,
                    "agents": args.agents,
                    "data": args.data,
                    "seed": args.seed,
                    "deadline_s": args.deadline,
                    "profile": profile_doc(args),
                }
            )
    return out


def _fleet_profile(doc: Record) -> Any:
    from coordinator.sim.profile import load_profile

    def table(values: Record) -> str:
        return "".join(f"{k} = {v!r}\n" for k, v in values.items())

    text = f"seed = {doc['seed']}\n[default]\n{table(doc['default'])}"
    text += "".join(f"[[group]]\n{table(g)}" for g in doc["group"])
    with tempfile.TemporaryDirectory() as tmp:  # one parser of profiles: the file's
        path = Path(tmp) / "profile.toml"
        path.write_text(text)
        return load_profile(path)


def execute(spec: Record, threads: int = 1) -> Record:
    """Run one spec; its step records reduced to the curve and the final accuracies."""
    import torch

    import coordinator.strategies  # noqa: F401 - registers every server half
    import edge_agent.algorithms  # noqa: F401 - registers every edge half
    from coordinator.config import load_config
    from coordinator.sim.simulate import simulate
    from models.families import FAMILIES as MODEL_FAMILIES

    torch.set_num_threads(threads)
    run = SimRun(
        algorithm=spec["algorithm"],
        hyper={},
        seed=spec["seed"],
        rounds=spec["rounds"],
        clients=spec["agents"],
        models=tuple(MODEL_FAMILIES[spec["family"]]),
        data=spec["data"],
        feature_dim=64,
        deadline_s=spec["deadline_s"],
        run_id=f"async-{spec['algorithm']}-{spec['mode']}",
    )
    mode: Record = {"mode": spec["mode"], "deadline_mode": "adaptive"}
    if spec["mode"] == "buffered":
        mode |= {"buffer_size": spec["buffer_size"], "max_staleness": spec["max_staleness"]}
    run_dir = Path(tempfile.mkdtemp(prefix=f"{run.run_id}-"))
    try:
        cfg = load_config(None, [], **run.config_values(run_dir), **mode)
        fleet = dataclasses.replace(run.fleet(), profile=_fleet_profile(spec["profile"]))
        t0 = time.time()
        result = simulate(cfg, fleet)
        wall = time.time() - t0
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"spec": spec, "wall_s": wall, **summarise(result.metrics)}


def summarise(steps: list[Record]) -> Record:
    """The accuracy-against-time curve of the training steps and the final accuracies."""
    train = train_steps(steps)
    if not train:
        return {"curve": [], "final": {}}
    start = float(train[0]["time"]) - float(train[0].get("duration_s", 0.0))
    curve = [
        {
            "round": s["round"],
            "t_s": float(s["time"]) - start,
            "acc_global": s.get("mean_acc_global"),
            "acc_local": s.get("mean_acc_local"),
            "bytes": s.get("bytes_total", 0),
            "replies": len(s.get("agents", {})),
            "stale_replies": sum(1 for v in s.get("staleness", {}).values() if v > 0),
        }
        for s in train
    ]
    final = [s for s in steps if s["phase"] == "final"]
    last = final[-1] if final else {}
    return {
        "curve": curve,
        "final": {
            "acc_global": last.get("mean_acc_global"),
            "acc_local": last.get("mean_acc_local"),
        },
    }


def acc_at(curve: list[Record], budget: float) -> float | None:
    """The global accuracy of the last step closed within ``budget`` seconds."""
    seen = [p["acc_global"] for p in curve if p["t_s"] <= budget and p["acc_global"] is not None]
    return seen[-1] if seen else None


def setting(spec: Record) -> str:
    """A run's identity less its seed (the fleet's seed is the run's)."""
    profile = {k: v for k, v in spec["profile"].items() if k != "seed"}
    return spec_key({**{k: v for k, v in spec.items() if k != "seed"}, "profile": profile})


def reach(curve: list[Record], target: float | None) -> float | None:
    """When the curve's global accuracy first reached ``target`` (``None``: never)."""
    if target is None:
        return None
    hits = [p["t_s"] for p in curve if p["acc_global"] is not None and p["acc_global"] >= target]
    return hits[0] if hits else None


def summary(runs: list[Record]) -> str:
    """Markdown: per algorithm, over the seeds run in both modes, the buffered run's time to
    the synchronous run's final global accuracy (as a share of the synchronous run's training
    time) and the difference of their final accuracies (mean [95 % t interval])."""
    by: dict[str, dict[int, dict[str, Record]]] = {}
    for r in runs:
        s = r["spec"]
        by.setdefault(s["algorithm"], {}).setdefault(s["seed"], {})[s["mode"]] = r
    lines = [
        "| algorithm | seeds | sync training s | buffered s to sync's final acc_global "
        "(share of sync's time) | reached in | final acc_global, buffered − sync (points) |",
        "|---|---|---|---|---|---|",
    ]
    for algorithm, seeds in sorted(by.items()):
        pairs = [(m["sync"], m["buffered"]) for m in seeds.values() if len(m) == len(MODES)]
        pairs = [(a, b) for a, b in pairs if a["curve"] and b["curve"]]
        if not pairs:
            continue
        ends = [a["curve"][-1]["t_s"] for a, _ in pairs]  # the synchronous runs' training time
        times = [reach(b["curve"], a["final"].get("acc_global")) for a, b in pairs]
        shares = [t / e for t, e in zip(times, ends, strict=True) if t is not None]
        diffs = [
            b["final"]["acc_global"] - a["final"]["acc_global"]
            for a, b in pairs
            if a["final"].get("acc_global") is not None and b["final"].get("acc_global") is not None
        ]
        reached = [t for t in times if t is not None]
        time_cell = (
            "-"
            if not reached
            else (f"{statistics.fmean(reached):.1f} ({100 * statistics.fmean(shares):.0f} %)")
        )
        lines.append(
            f"| {algorithm} | {len(pairs)} | {statistics.fmean(ends):.1f} | {time_cell} "
            f"| {len(reached)} of {len(pairs)} | {ci_cell(diffs) if diffs else '-'} |"
        )
    return "\n".join(lines) + "\n"


def table(runs: list[Record]) -> str:
    """Markdown: per algorithm, each mode at the common time budget and at its end."""

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f}"

    lines = [
        "| algorithm | seed | mode | versions | train s | s/version | acc_global @ budget (s) | "
        "final acc_global | final acc_local | bytes/version | stale replies |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_algo: dict[str, list[Record]] = {}
    for r in runs:
        by_algo.setdefault(r["spec"]["algorithm"], []).append(r)
    for algorithm, group in sorted(by_algo.items()):
        for r in sorted(group, key=lambda x: (x["spec"]["seed"], MODES.index(x["spec"]["mode"]))):
            pair = [x["curve"][-1]["t_s"] for x in group if x["spec"]["seed"] == r["spec"]["seed"]]
            budget = min(pair) if all(x["curve"] for x in group) else 0.0
            curve = r["curve"]
            n = len(curve)
            end = curve[-1]["t_s"] if curve else 0.0
            per_step = sum(p["bytes"] for p in curve) / max(n, 1)
            lines.append(
                f"| {algorithm} | {r['spec']['seed']} | {r['spec']['mode']} | {n} | {end:.1f} "
                f"| {end / max(n, 1):.2f} "
                f"| {pct(acc_at(curve, budget))} ({budget:.0f}) | {pct(r['final']['acc_global'])} "
                f"| {pct(r['final']['acc_local'])} | {per_step:,.0f} "
                f"| {sum(p['stale_replies'] for p in curve)} |"
            )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``: None reads ``sys.argv``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--algorithms", default="fedavg,fedproto,felo")
    ap.add_argument("--agents", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=20, help="synchronous rounds")
    ap.add_argument(
        "--buffered-rounds",
        type=int,
        default=0,
        help="buffered versions (0: rounds x agents / buffer size, about the same replies)",
    )
    ap.add_argument("--buffer-size", type=int, default=0, help="0: half the agents")
    ap.add_argument("--max-staleness", type=int, default=4)
    ap.add_argument("--slow-share", type=float, default=0.2)
    ap.add_argument("--slow-factor", type=float, default=10.0)
    ap.add_argument("--dropout", type=float, default=0.1, help="per task, every device")
    ap.add_argument("--data", default="digits")
    ap.add_argument("--seed", type=int, default=0)
    add_grid_args(ap, "benchmarks/results/async_fleet.json", jobs=False, deadline=60.0)
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    md = args.md or args.out.with_suffix(".md")
    if not args.table_only:

        def run(spec: Record) -> Record:
            return execute(spec, args.threads)

        def describe(r: Record) -> str:
            curve = r["curve"]
            end = curve[-1]["t_s"] if curve else 0.0
            return f"{r['spec']['mode']}: {len(curve)} versions in {end:.1f} s"

        run_grid(args.out, specs(args), run, describe=describe, code=args.code or code_label())
    runs, _ = load_results(args.out)
    keys = {setting(s) for s in specs(args)}  # this invocation's settings, every seed run
    chosen = [r for r in runs if setting(r["spec"]) in keys]
    text = summary(chosen) + "\n" + table(chosen)
    write_markdown(md, text)
    print(text)


if __name__ == "__main__":
    main()
