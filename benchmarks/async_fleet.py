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

Clock (``--clock``). ``simulated`` (the default) runs on
:class:`coordinator.sim.clock.SimulatedClock`: nothing is slept, each reply is scheduled at its
simulated arrival, and the step records' ``time`` and ``duration_s`` are simulated seconds,
free of the host's load. By default every task costs a fixed ``--compute-s`` (1 s) of compute
times the device's speed factor (1 s on a normal device, 10 s on a slow one), not the compute
time measured on this host: agents that train at once on a shared machine inflate each other's
measured time, so the measured timeline would still carry the load and change from run to run;
a fixed cost gives the same timeline for the same replies. It leaves out that tasks of
different algorithms and architectures cost differently, so the times compare the two modes of
one algorithm, not algorithms with each other. ``--compute-s 0`` uses the measured time.
``real`` waits in wall-clock time (the times then include the host's load and the
coordinator's own work). A simulated run's spec records ``clock`` and ``compute_s``; a spec
without ``clock`` ran on the real clock. Each clock has its own default results file.

Recorded per run: each training step's time since the first step's dispatch (on the run's
clock), the agents' mean global and local accuracy after it and its bytes (the coordinator's
endpoint counters; the agents' progress heartbeats left out); the final step's accuracies. The
markdown tables compare the two modes per algorithm: the time and bytes the buffered run took
to reach the synchronous run's final global accuracy, and the final accuracies. Results:
``benchmarks/results/async_fleet_simclock.json`` (simulated clock) or
``benchmarks/results/async_fleet.json`` (real clock), appended after each run and resumed on
rerun; tables beside them (``.md``).

Usage::

    python benchmarks/async_fleet.py --agents 20 --rounds 20 --seed S
    python benchmarks/async_fleet.py --agents 5 --rounds 2 --algorithms felo   # a smoke
    python benchmarks/async_fleet.py --clock real --agents 10 --rounds 20 --seed S
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
CLOCKS = ("simulated", "real")
RESULTS = {
    "simulated": "benchmarks/results/async_fleet_simclock.json",
    "real": "benchmarks/results/async_fleet.json",
}
GOAL_SHARE = 0.5  # buffered reaches sync's final global accuracy in at most this share of its time
GOAL_POINTS = 1.0  # ...and ends at most this many points of global accuracy below it


def profile_doc(args: argparse.Namespace) -> Record:
    """The fleet's device profile as the spec records it (the profile file's tables)."""
    return {
        "seed": args.seed,
        "group": [{"share": args.slow_share, "speed": args.slow_factor, "dropout": args.dropout}],
        "default": {"dropout": args.dropout},
    }


def clock_doc(args: argparse.Namespace) -> Record:
    """The clock as the spec records it: nothing for the real clock (the specs of the results
    measured before the simulated clock had no such key), else the clock and the fixed compute
    time per task (``None``: measured on this host)."""
    if args.clock == "real":
        return {}
    return {"clock": "simulated", "compute_s": args.compute_s or None}


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
                    **clock_doc(args),
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
    import coordinator.strategies  # noqa: F401 - registers every server half
    import edge_agent.algorithms  # noqa: F401 - registers every edge half
    from coordinator.config import load_config
    from coordinator.sim.clock import SimulatedClock
    from coordinator.sim.simulate import simulate
    from models.cpu_threads import limit_cpu_threads
    from models.families import FAMILIES as MODEL_FAMILIES

    limit_cpu_threads(threads)
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
        clock = None
        if spec.get("clock") == "simulated":
            clock = SimulatedClock(compute_s=spec["compute_s"])
        t0 = time.time()
        result = simulate(cfg, fleet, clock=clock)
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


def reach(curve: list[Record], target: float | None) -> int | None:
    """The index of the first step whose global accuracy reached ``target`` (``None``:
    never)."""
    if target is None:
        return None
    hits = [
        i for i, p in enumerate(curve) if p["acc_global"] is not None and p["acc_global"] >= target
    ]
    return hits[0] if hits else None


def curve_bytes(curve: list[Record], upto: int | None = None) -> int:
    """The bytes of the curve's steps, up to and including step ``upto`` (``None``: all)."""
    points = curve if upto is None else curve[: upto + 1]
    return sum(int(p.get("bytes", 0)) for p in points)


def clock_note(runs: list[Record]) -> str:
    """The line saying which clock the runs' times are on."""
    clocks = {r["spec"].get("clock", "real") for r in runs}
    if clocks != {"simulated"}:
        return "Times: wall-clock seconds since the first dispatch (the real clock).\n"
    computes = {r["spec"].get("compute_s") for r in runs}
    cost = (
        "each task's compute time measured on the host x the device's speed"
        if computes == {None}
        else "each task "
        + " or ".join(f"{c:g} s" for c in sorted(c for c in computes if c is not None))
        + " of compute x the device's speed, fixed so that the host's load leaves the timeline"
        " alone"
    )
    return f"Times: simulated seconds since the first dispatch (the simulated clock: {cost}).\n"


def summary(runs: list[Record]) -> str:
    """Markdown: per algorithm, over the seeds run in both modes, the buffered run's time and
    bytes to the synchronous run's final global accuracy (as shares of the synchronous run's
    training time and bytes), the difference of their final accuracies (mean [95 % t
    interval]) and whether the goal is met: reached in every seed, in at most
    :data:`GOAL_SHARE` of the time on average, and at most :data:`GOAL_POINTS` below at the
    end on average."""
    by: dict[str, dict[int, dict[str, Record]]] = {}
    for r in runs:
        s = r["spec"]
        by.setdefault(s["algorithm"], {}).setdefault(s["seed"], {})[s["mode"]] = r
    lines = [
        "| algorithm | seeds | sync training s | buffered s to sync's final acc_global "
        "(share of sync's time) | reached in | sync training bytes | buffered bytes to it "
        "(share of sync's bytes) | final acc_global, buffered − sync (points) | goal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for algorithm, seeds in sorted(by.items()):
        pairs = [(m["sync"], m["buffered"]) for m in seeds.values() if len(m) == len(MODES)]
        pairs = [(a, b) for a, b in pairs if a["curve"] and b["curve"]]
        if not pairs:
            continue
        hits = [(a, b, reach(b["curve"], a["final"].get("acc_global"))) for a, b in pairs]
        reached = [(a, b, i) for a, b, i in hits if i is not None]
        times = [b["curve"][i]["t_s"] for _, b, i in reached]
        shares = [b["curve"][i]["t_s"] / a["curve"][-1]["t_s"] for a, b, i in reached]
        sent = [curve_bytes(b["curve"], i) for _, b, i in reached]
        sent_shares = [curve_bytes(b["curve"], i) / curve_bytes(a["curve"]) for a, b, i in reached]
        diffs = [
            b["final"]["acc_global"] - a["final"]["acc_global"]
            for a, b in pairs
            if a["final"].get("acc_global") is not None and b["final"].get("acc_global") is not None
        ]
        met = (
            len(reached) == len(pairs)
            and statistics.fmean(shares) <= GOAL_SHARE
            and bool(diffs)
            and 100 * statistics.fmean(diffs) >= -GOAL_POINTS
        )
        time_cell = (
            f"{statistics.fmean(times):.1f} ({100 * statistics.fmean(shares):.0f} %)"
            if reached
            else "-"
        )
        bytes_cell = (
            f"{statistics.fmean(sent):,.0f} ({100 * statistics.fmean(sent_shares):.0f} %)"
            if reached
            else "-"
        )
        sync_bytes = statistics.fmean(curve_bytes(a["curve"]) for a, _ in pairs)
        lines.append(
            f"| {algorithm} | {len(pairs)} "
            f"| {statistics.fmean(a['curve'][-1]['t_s'] for a, _ in pairs):.1f} | {time_cell} "
            f"| {len(reached)} of {len(pairs)} | {sync_bytes:,.0f} | {bytes_cell} "
            f"| {ci_cell(diffs) if diffs else '-'} | {'met' if met else 'not met'} |"
        )
    return clock_note(runs) + "\n" + "\n".join(lines) + "\n"


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
    ap.add_argument(
        "--clock",
        choices=CLOCKS,
        default="simulated",
        help="simulated: nothing slept, times in simulated seconds; real: wall-clock waiting",
    )
    ap.add_argument(
        "--compute-s",
        type=float,
        default=1.0,
        help="simulated clock: each task's compute time on a speed-1 device (0: measured)",
    )
    add_grid_args(ap, None, jobs=False, deadline=60.0)
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = Path(RESULTS[args.clock])
    return args


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
