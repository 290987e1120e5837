"""Every registered algorithm on the same splits, in one table.

Every run goes through :func:`coordinator.sim.simulate.simulate` (the in-memory transport, the same
code paths as a real fleet), so accuracies are what the agents report and bytes are what the
coordinator's endpoint counted.

Setting: the algorithms registered in ``coordinator.strategies`` (not a hand list), each with
its own config's defaults (its paper's, ``protocol/algorithms/<name>.py``) and only what it
needs to run at all (``NEEDS``); 20 clients with full participation, the heterogeneous family
``tiny`` (client i gets ``mlp_s, cnn_t1, cnn_t2, mlp_m, cnn_t3``[i mod 5]), feature dimension
64, Dirichlet(alpha) label skew with alpha 0.1 and 1.0, a stratified global test set held out
first, 20 % of each client's data as its own test split; ``digits`` (8x8) and ``mnist5k``
(28x28); seeds 0-2.

Reported per algorithm, after its ``final`` step (mean ± sd over seeds): personalised accuracy
(each client's model on its own test split, weighted by the split's size) and global accuracy
(each client's model on the global test set, mean over clients); bytes per client per round
down and up (training rounds 2.., from the transport's counters, without progress messages);
the whole run's bytes (set-up round and final steps included); seconds per training round.

Usage::

    python benchmarks/compare.py --quick --jobs 2   # digits, seed 0, 10 rounds
    python benchmarks/compare.py --jobs 2           # the full grid
    python benchmarks/compare.py --quick --table-only   # rewrite docs/results/common.md only

Settings, the smoke and full grids (``--quick`` = ``--preset quick``), the common training
recipe and what each algorithm needs: ``benchmarks/presets/compare.toml``. ``--quick`` results
go to ``benchmarks/results/compare_quick.json``, the full grid's to
``benchmarks/results/compare.json``; both write ``docs/results/common.md`` (``--md``).

Results are appended to ``--out`` after every run; a rerun skips runs already there with the
same settings, so an interrupted grid resumes. A run that raises is recorded under
``failures`` (with its traceback and the errors logged during it) and retried next time.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import experiment
from experiment.summary import steps_failed
from harness import (
    IMAGE_SIZE,
    SimRun,
    client_test_sizes,
    final_step,
    group_by,
    host_label,
    mean_sd,
    merge_results,
    personalised_accuracy,
    simulate_run,
    spec_key,
    step_bytes,
    train_steps,
)

# the in-process transport's agents and the coordinator log per step; the grid prints a line
# per run instead
logging.basicConfig(level=logging.ERROR)

PRESET = experiment.load_preset("compare")
GLOBAL_TEST: dict[str, int] = PRESET.other["global_test"]
FEATURE_DIM: int = PRESET.other["fleet"]["feature_dim"]
# what an algorithm needs beyond its config's defaults to run in this setting at all
NEEDS: dict[str, dict[str, Any]] = PRESET.other["needs"]
# Scheduled first (in this order) so that a pool of runs ends together instead of waiting on one
# slow run started last: their seconds per round on digits, 20 clients, were 2-10x the others'
# (FedVTC trains its generator on every client, Velo a CVAE and FedKTL its adapter on the server).
SLOW_FIRST = ("fedvtc", "velo", "fedtgp", "fedktl", "fedkd", "fedgen", "fedtype")
# one local-training recipe for every row (``--train common``)
COMMON_TRAIN: dict[str, Any] = PRESET.other["common_train"]
QUICK: dict[str, Any] = PRESET.named["quick"]
FULL: dict[str, Any] = PRESET.named["full"]
FULL_OWN: dict[str, Any] = {**FULL, **PRESET.other["own_grid"]}
DEFAULT_ALPHAS: list[float] = PRESET.settings["alphas"]


def registered() -> list[str]:
    """The algorithms registered on the coordinator (``coordinator.strategies``, torch-free)."""
    from coordinator.strategies import STRATEGIES

    return sorted(STRATEGIES)


def not_applicable(algorithm: str, family: str) -> str | None:
    """Why ``algorithm`` cannot run on ``family`` at all (it would only be refused), or None."""
    from coordinator.strategies import STRATEGIES
    from models.families import family_members

    if STRATEGIES[algorithm].one_architecture and len(set(family_members(family))) > 1:
        return "averages whole models, so it needs one architecture (`--family homo_mlp`)"
    return None


def add_args(ap: argparse.ArgumentParser) -> None:
    """The script's own options (defaults: benchmarks/presets/compare.toml)."""
    ap.add_argument("--quick", action="store_true", help=f"smoke setting: {QUICK}")
    ap.add_argument("--algorithms", nargs="+", default=None, help="default: all registered")
    ap.add_argument("--data", nargs="+", default=None, choices=sorted(IMAGE_SIZE))
    ap.add_argument("--alphas", nargs="+", type=float, help="Dirichlet")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--clients", type=int)
    ap.add_argument("--family", help="models.families name")
    ap.add_argument("--wait-agents", type=float, help="registration wait (s)")
    ap.add_argument(
        "--train",
        choices=("common", "own"),
        help="common: one local-training recipe for every algorithm (HtFLlib's: SGD lr 0.01, "
        "batch 10, 1 epoch); own: each algorithm's config defaults",
    )
    ap.add_argument(
        "--device",
        help="where agents and server-side training run (cpu, cuda); recorded with each run, "
        "not part of its identity: the same spec on another device is the same run (a run "
        "in --work-dir resumes on its own device only)",
    )
    ap.add_argument(
        "--server-device",
        default=None,
        help="where the coordinator's server-side training runs (default: --device); e.g. "
        "agents on the CPU cores and Velo's CVAE on the GPU; recorded like --device",
    )
    ap.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=[],
        metavar="FILE",
        help="first add these results files' runs (another machine's, e.g. a GPU lease's "
        "$OUT/compare_gpu.json) to --out where --out lacks their specs",
    )
    ap.add_argument(
        "--hyper",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="algorithm settings over the recipe (TOML literals), for an ablation: the rows are "
        "named ALGORITHM[KEY=VALUE,...]; write them to their own --out and --md",
    )


def finish_args(args: argparse.Namespace) -> None:
    """``--quick`` fills in the smoke setting, else the full grid fills in what is left open;
    ``--out`` and ``--md`` default to the recipe's and the setting's own files."""
    args.quick = args.quick or args.preset == "quick"
    if args.md is None:  # the results pages: one recipe for every row, and each row's own
        page = "common" if args.train == "common" else "own"
        args.md = Path(f"docs/results/{page}.md")
    preset = grid_preset(args)
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        name = "compare_quick" if args.quick else "compare"
        args.out = (
            Path("benchmarks/results") / f"{name}{'_own' if args.train == 'own' else ''}.json"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the defaults of benchmarks/presets/compare.toml."""
    return experiment.parse_args(EXPERIMENT, argv)


def run_spec(
    args: argparse.Namespace, algorithm: str, data: str, alpha: float, seed: int
) -> dict[str, Any]:
    """Everything that determines one run (also its identity in the results file)."""
    needs = NEEDS.get(algorithm, {})
    feature_dim = needs.get("feature_dim", {}).get(data, FEATURE_DIM)
    overrides = ablation(args.hyper)
    label = ",".join(f"{k}={v}" for k, v in overrides.items())
    return {
        "method": f"{algorithm}[{label}]" if overrides else algorithm,
        "algorithm": algorithm,
        "data": data,
        "family": args.family,
        "alpha": alpha,
        "seed": seed,
        "rounds": args.rounds,
        "clients": args.clients,
        "feature_dim": feature_dim,
        "global_test": GLOBAL_TEST[data],
        "hyper": {
            **(COMMON_TRAIN if args.train == "common" else {}),
            **needs.get("hyper", {}),
            **overrides,
        },
    }


def ablation(items: list[str]) -> dict[str, Any]:
    """``["predict=head"]`` -> ``{"predict": "head"}`` (values parsed as the CLI's ``--set``)."""
    from coordinator.config import parse_override

    out: dict[str, Any] = {}
    for item in items:
        _section, key, value = parse_override(f"hyper.{item}")
        out[key] = value
    return out


def sim_run(spec: dict[str, Any], args: argparse.Namespace) -> SimRun:
    """The simulation of ``spec``: its agents on ``--device``, the coordinator's server-side
    training on ``--server-device`` (default: ``--device``)."""
    from models.families import family_models

    return SimRun.from_spec(
        spec,
        models=tuple(family_models(spec["family"], spec["clients"])),
        image_size=IMAGE_SIZE[spec["data"]],
        deadline_s=args.deadline,
        wait_agents_s=args.wait_agents,
        run_id="compare",
        device=args.device,
        server_device=args.server_device,
    )


def execute(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Run one simulation and reduce its step records to the table's figures."""
    run = sim_run(spec, args)
    device, server_device = args.device, args.server_device
    steps, wall = simulate_run(run, args.threads, args.work_dir)
    summary = summarize(steps, client_test_sizes(run))
    host = host_label()
    where = {"device": device, "server_device": server_device or device}
    return {"spec": spec, "wall_s": wall, **where, "host": host, **summary}


def schedule(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``specs`` with MNIST-5k before digits and the slow algorithms first (stable otherwise)."""

    def rank(spec: dict[str, Any]) -> tuple[int, int]:
        alg = spec["algorithm"]
        slow = SLOW_FIRST.index(alg) if alg in SLOW_FIRST else len(SLOW_FIRST)
        return (-list(IMAGE_SIZE).index(spec["data"]), slow)

    return sorted(specs, key=rank)


def summarize(steps: list[dict[str, Any]], test_sizes: list[int]) -> dict[str, Any]:
    """Final accuracies (personalised sample-weighted, global client mean), bytes, seconds."""
    last = final_step(steps)
    agents = last["agents"]
    glob = [float(a["acc_global"]) for a in agents.values() if a.get("acc_global") is not None]
    train = train_steps(steps)
    later = train[1:] or train  # round 1 carries the set-up
    return {
        "final_phase": last["phase"],
        "final_agents": len(agents),
        "acc_personal": personalised_accuracy(agents, test_sizes),
        "acc_global": statistics.fmean(glob) if glob else None,
        "down_per_client": statistics.fmean(
            step_bytes(s, "tx", progress=False) / max(len(s["agents"]), 1) for s in later
        ),
        "up_per_client": statistics.fmean(
            step_bytes(s, "rx", progress=False) / max(len(s["agents"]), 1) for s in later
        ),
        "bytes_run": sum(step_bytes(s, d, progress=False) for s in steps for d in ("tx", "rx")),
        "s_per_round": statistics.fmean(float(s["duration_s"]) for s in train),
        "rounds_done": len(train),
        "steps_failed": steps_failed(steps),
        # agent tasks that failed while the step still met its quorum
        "tasks_failed": sum(len(s.get("failed") or {}) for s in steps),
        "per_round": [
            {
                "round": s["round"],
                "n": len(s["agents"]),
                "down": step_bytes(s, "tx", progress=False),
                "up": step_bytes(s, "rx", progress=False),
                "s": s["duration_s"],
                "acc_local": s.get("mean_acc_local"),
                "acc_global": s.get("mean_acc_global"),
            }
            for s in train
        ],
    }


# ----- the page -------------------------------------------------------------------------------
def _acc(vals: list[float | None]) -> str:
    xs = [v for v in vals if v is not None]
    if len(xs) == 1:  # one seed: no spread to state
        return f"{100 * xs[0]:.1f}"
    return mean_sd(xs)


def _kb(vals: list[float]) -> str:
    return f"{statistics.fmean(vals) / 1e3:,.1f}"


def _best(rows: dict[str, list[dict[str, Any]]], key: str) -> str | None:
    means = {
        m: statistics.fmean(r[key] for r in rs)
        for m, rs in rows.items()
        if all(r.get(key) is not None for r in rs)
    }
    return max(means, key=lambda m: means[m]) if means else None


def setting_table(
    runs: list[dict[str, Any]],
    fails: list[dict[str, Any]],
    skipped: dict[str, str],
    missing: list[str] | None = None,
) -> list[str]:
    """One setting's rows: every algorithm that ran, every one that only failed, every one not
    run yet (``missing``), then every one that does not apply to the fleet (``skipped``:
    algorithm -> why)."""
    by_alg = group_by(sorted(runs, key=_alg), _alg)
    best_p, best_g = _best(by_alg, "acc_personal"), _best(by_alg, "acc_global")
    lines = [
        "| algorithm | seeds | personalised % | global % | down kB/client/round | "
        "up kB/client/round | run MB | s/round | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for alg, rs in by_alg.items():
        pers = _acc([r["acc_personal"] for r in rs])
        glob = _acc([r["acc_global"] for r in rs])
        lines.append(
            f"| `{alg}` | {len(rs)} | {f'**{pers}**' if alg == best_p else pers} | "
            f"{f'**{glob}**' if alg == best_g else glob} | "
            f"{_kb([r['down_per_client'] for r in rs])} | "
            f"{_kb([r['up_per_client'] for r in rs])} | "
            f"{statistics.fmean(r['bytes_run'] for r in rs) / 1e6:,.2f} | "
            f"{statistics.fmean(r['s_per_round'] for r in rs):.1f} | {_notes(rs)} |"
        )
    for alg, fs in group_by(fails, _alg).items():
        if alg not in by_alg:
            lines.append(
                f"| `{alg}` | 0 | failed ([below](#failures)): {_cause(fs[0])} | | | | | | |"
            )
    failed = {_alg(f) for f in fails}
    for alg in sorted(set(missing or []) - set(by_alg) - failed):
        lines.append(f"| `{alg}` | 0 | not run yet | | | | | | |")
    for alg, why in sorted(skipped.items()):
        lines.append(f"| `{alg}` | – | not run: {why} | | | | | | |")
    verdict = (
        f"Best on both metrics: `{best_p}`."
        if best_p == best_g
        else f"No algorithm is best on both: personalised `{best_p}`, global `{best_g}`."
    )
    pending = sorted(set(missing or []) - set(by_alg))
    if pending:  # a partial table ranks only what ran
        verdict += f" (Among the {len(by_alg)} run so far; {len(pending)} not run yet.)"
    return [*lines, "", verdict]


def overall_section(
    by_setting: dict[Any, list[dict[str, Any]]], partial: bool, demo: str | None = None
) -> list[str]:
    """The table's pick (the demo's default): the algorithm best on both metrics
    in the most settings; a tie goes to the lower mean rank over every (setting, metric).
    Ranked: the algorithms with runs in every setting."""
    if len(by_setting) < 2:
        return []
    tables = [group_by(sorted(rs, key=_alg), _alg) for rs in by_setting.values()]
    everywhere = set.intersection(*(set(t) for t in tables))
    if not everywhere:
        return []
    wins: Counter[str] = Counter()
    ranks: dict[str, list[int]] = {alg: [] for alg in everywhere}
    for table in tables:
        ranked = {alg: table[alg] for alg in sorted(everywhere)}  # ties: by name, every run
        best = {key: _best(ranked, key) for key in ("acc_personal", "acc_global")}
        if best["acc_personal"] == best["acc_global"] and best["acc_personal"] is not None:
            wins[best["acc_personal"]] += 1
        for key in best:
            means = {alg: statistics.fmean(r[key] for r in rs) for alg, rs in ranked.items()}
            for i, alg in enumerate(sorted(means, key=lambda a: -means[a])):
                ranks[alg].append(i + 1)
    order = sorted(everywhere, key=lambda a: (-wins[a], statistics.fmean(ranks[a]), a))
    lines = [
        "## Overall",
        "",
        f"Over the {len(tables)} settings above, the {len(everywhere)} algorithms that ran in "
        "every one: in how many each is best on both metrics, and its mean rank over every "
        "(setting, metric) (1 = best).",
        "",
        "| algorithm | best on both in | mean rank |",
        "|---|---|---|",
        *(
            f"| `{a}` | {wins[a]} of {len(tables)} | {statistics.fmean(ranks[a]):.1f} |"
            for a in order
        ),
        "",
        pick_line(order[0], partial, demo),
        "",
    ]
    return lines


def pick_line(pick: str, partial: bool, demo: str | None) -> str:
    """The table's pick, and whether the demo runs it (it is meant to)."""
    line = f"The table's pick (the most settings best on both, then the lower mean rank): `{pick}`"
    line += " (provisional: some runs of the grid are not done yet)." if partial else "."
    if demo is not None and demo != pick:
        line += (
            f" `coordinator demo` runs `{demo}` (`[settings]` of "
            "`coordinator/presets/demo.toml`), not the pick: the comment there says why."
        )
    return line


def _notes(rs: list[dict[str, Any]]) -> str:
    """What a row's accuracy hides: agent tasks that failed, agents missing at the end."""
    notes = []
    for key, what in (("device", "runs on"), ("server_device", "runs' server training on")):
        devices = sorted({r.get(key, r.get("device", "cpu")) for r in rs} - {"cpu"})
        if devices:
            on = sum(1 for r in rs if r.get(key, r.get("device", "cpu")) != "cpu")
            notes.append(f"{on} of {len(rs)} {what} {', '.join(devices)}")
    tasks = sum(r.get("tasks_failed", 0) for r in rs)
    if tasks:
        notes.append(f"{tasks} agent tasks failed")
    short = [r for r in rs if r["final_agents"] < r["spec"]["clients"]]
    if short:
        notes.append(f"final step: {min(r['final_agents'] for r in short)} agents")
    return "; ".join(notes)


def _alg(r: dict[str, Any]) -> str:
    return str(r["spec"].get("method", r["spec"]["algorithm"]))  # an ablation's own row


def _cause(failure: dict[str, Any]) -> str:
    """The first error an agent or the coordinator logged (the why), else the exception."""
    logged = failure.get("log") or [failure["error"]]
    return _short(logged[0].split(": ", 1)[-1].split("; ")[0])


def _short(text: str, width: int = 90) -> str:
    one = " ".join(text.split()).replace("|", "/")
    return one if len(one) <= width else one[: width - 1] + "…"


def failures_section(failures: list[dict[str, Any]]) -> list[str]:
    """Each algorithm's failure once: its settings, the error, the errors logged during the
    run (why agents stopped) and the end of the traceback."""
    if not failures:
        return []
    out = ["", "## Failures", ""]
    for alg, fs in sorted(group_by(failures, _alg).items()):
        where = ", ".join(
            f"{f['spec']['data']} Dir({_alpha(f['spec']['alpha'])}) seed {f['spec']['seed']}"
            for f in fs
        )
        text = fs[0]["traceback"].strip().splitlines()[-3:]
        if fs[0].get("log"):
            text += ["logged during the run (first ones):", *fs[0]["log"][:3]]
        out += [
            f"- `{alg}` ({where}): `{_short(fs[0]['error'], 300)}`",
            "",
            "  ```text",
            *(f"  {line}" for line in text),
            "  ```",
            "",
        ]
    return out


def _alpha(alpha: float) -> str:
    return str(float(alpha))  # 0.1, 1.0 (as the papers write them)


def page(
    args: argparse.Namespace,
    runs: list[dict[str, Any]],
    fails: list[dict[str, Any]],
    skipped: dict[str, str] | None = None,
    planned: list[dict[str, Any]] | None = None,
) -> str:
    """docs/results/common.md: settings, one table per (data, alpha), failures, how to rerun."""
    label = "quick (smoke) setting" if args.quick else "full grid"
    codes = sorted({str(r.get("code")) for r in runs})
    hosts = sorted({str(r.get("host", "not recorded")) for r in runs})
    lines = [
        "# One table of every algorithm",
        "",
        f"**{label}**: {', '.join(args.data)}; {args.clients} clients, all in every round; "
        f"family `{args.family}`; Dirichlet alpha {', '.join(map(_alpha, args.alphas))}; "
        f"{args.rounds} rounds; seeds {', '.join(map(str, args.seeds))}; "
        f"{args.threads} torch thread(s) per run; "
        f"code {', '.join(codes) or '–'}; ran on {'; '.join(hosts) or '–'}. Produced by "
        f"`{command(args)}` (results: `{args.out}`, with every command that added runs).",
        "",
        *(QUICK_TEXT if args.quick else []),
        *(COMMON_TEXT if args.train == "common" else OWN_TEXT),
        *SETTINGS_TEXT,
    ]

    def where(r: dict[str, Any]) -> tuple[str, float]:
        spec = r.get("spec", r)
        return (spec["data"], spec["alpha"])

    settings = group_by(runs + fails + (planned or []), where)
    done = {spec_key(r["spec"]) for r in runs}
    for data, alpha in sorted(settings, key=lambda k: (list(IMAGE_SIZE).index(k[0]), k[1])):
        mine = [r for r in runs if where(r) == (data, alpha)]
        theirs = [f for f in fails if where(f) == (data, alpha)]
        missing = [
            s.get("method", s["algorithm"])
            for s in planned or []
            if where(s) == (data, alpha) and spec_key(s) not in done
        ]
        table = setting_table(mine, theirs, skipped or {}, missing)
        lines += [f"## {data}, Dir({_alpha(alpha)})", "", *table, ""]
    partial = any(spec_key(s) not in done for s in planned or [])
    lines += overall_section(group_by(runs, where), partial, demo_default())
    lines += failures_section(fails)
    lines += [*rerun_text(args), *(cost_estimate(args, runs, fails) if args.quick else [])]
    return "\n".join(lines).rstrip() + "\n"


def command(args: argparse.Namespace) -> str:
    """The command line that reruns this page's grid."""
    preset = grid_preset(args)
    parts = ["python benchmarks/compare.py", "--quick" if args.quick else ""]
    parts += [f"--rounds {args.rounds}" if args.rounds != preset["rounds"] else ""]
    parts += [f"--data {' '.join(args.data)}" if args.data != preset["data"] else ""]
    # the page shows every algorithm, so it reruns with all of them (the calls that added runs
    # are listed in the results file); an ablation's page is its own algorithms'
    ablation_of = args.algorithms if args.hyper else None
    parts += [f"--algorithms {' '.join(ablation_of)}" if ablation_of else ""]
    parts += ["--train own" if args.train == "own" else ""]
    parts += [f"--hyper {' '.join(args.hyper)}" if args.hyper else ""]
    parts += [f"--jobs {args.jobs} --threads {args.threads}"]
    return " ".join(p for p in parts if p)


# MNIST-5k (28x28, 5000 images) over digits (8x8, 1797) per round, the same fleet and
# settings: 5.4-7.1x for the client-bound Felo-family rows, 2.5x for Velo (server-bound), in
# benchmarks/results/felo_{digits,mnist5k}.json (10 clients, Dir 0.5)
MNIST_FACTOR = 6.0


def cost_estimate(
    args: argparse.Namespace, runs: list[dict[str, Any]], fails: list[dict[str, Any]]
) -> list[str]:
    """The full grid's CPU time extrapolated from this quick run's wall times."""
    per_round = [r["wall_s"] / r["spec"]["rounds"] for r in runs]
    if not per_round:
        return []
    settings = len({(r["spec"]["data"], r["spec"]["alpha"]) for r in runs})
    one = sum(per_round) / settings  # every algorithm once, one round, one setting
    seeds, rounds, alphas = len(FULL["seeds"]), FULL["rounds"], 2
    digits_h = one * rounds * seeds * alphas / 3600
    return [
        "",
        f"Cost, extrapolated from this page's wall times (all algorithms, one round, one "
        f"setting: {one:.0f} s, run start-up included): digits {digits_h:.1f} h, MNIST-5k "
        f"about {MNIST_FACTOR:g}x that ({MNIST_FACTOR * digits_h:.0f} h; the ratio measured on "
        f"the Felo grids), in all about {(1 + MNIST_FACTOR) * digits_h:.0f} run-hours (the sum "
        f"of the runs' wall times at the load this page ran under; `--jobs 2` halves the wall "
        f"time where two cores are free); each run of an algorithm that fails to start here "
        f"({', '.join(sorted({_alg(f) for f in fails})) or 'none'}) waits "
        f"{args.wait_agents:.0f} s (`--wait-agents`) before it is recorded as failed.",
    ]


QUICK_TEXT = [
    "This is the smoke setting: it shows that every algorithm runs (or how it fails) in the "
    "20-client heterogeneous fleet and what it costs in bytes and time. Ten rounds are too "
    "few to rank accuracies: the defaults that take few optimiser steps per round (plain SGD "
    "at lr 0.01 with batch 10, HtFLlib's, on 45-60 training images per client; Adam 1e-3 at "
    "batch 50 for the Felo family) leave most rows near chance at Dir 1.0.",
    "",
]
COMMON_TEXT = [
    "Every algorithm trains locally with one recipe, HtFLlib's: plain SGD, lr 0.01, batch 10, "
    "one epoch per round, no weight decay (`--train common`, `COMMON_TRAIN` in "
    "`benchmarks/compare.py`), so rows differ only in what the algorithms exchange and what "
    "they do with it; every other setting is the algorithm's own default (its paper's; "
    "`coordinator config --defaults`, `docs/algorithms/baselines.md`).",
    "",
]
OWN_TEXT = [
    "Each algorithm runs with its own config's defaults (its paper's; `coordinator config "
    "--defaults`, `docs/algorithms/baselines.md`), so optimiser, batch size and local epochs "
    "differ between rows (Adam for Felo, Velo, FedHe and FedType; five epochs for FedVTC and "
    "FedType; momentum 0.9 and batch 32 for `local` and FedProto): a row's lead may be its "
    "recipe's, not its exchange's. `--train common` gives every row one recipe.",
    "",
]
SETTINGS_TEXT = [
    "Beyond that, only what an algorithm needs to run here: FedKTL's agents have feature "
    "dimension 10 (its ETF head, K = C), FedVTC's 64 on digits and 980 on MNIST (its "
    "generator's latent), FedType's proxy is `mlp_xs` (the default is the paper's ResNet-18); "
    "every other agent has feature dimension 64. Global test set: 360 images (digits), 1000 "
    "(MNIST-5k), held out first, stratified; each client keeps 20 % of its data as its own "
    "test split.",
    "",
    "Columns: personalised = each client's model after the `final` step on its own test "
    "split, weighted by the split's size; global = the same models on the global test set, "
    "mean over clients (mean ± sd over seeds; one seed: the value). Bytes are the "
    "coordinator's transport counters per training round 2.. divided by the round's "
    "participants, without progress messages (round 1 carries the set-up); run MB = every "
    "step of the run, set-up and final steps included. s/round = the coordinator's mean "
    "training-step time on the machine that ran the page, shared with other jobs: "
    "an indication that moves by an order of magnitude with the load, not a benchmark. "
    "Bold = the best mean in the column; notes = agent tasks that failed inside steps that "
    "still met their quorum, agents missing from the final step.",
    "",
]


def rerun_text(args: argparse.Namespace) -> list[str]:
    """How to run the full grid of the page's recipe, and its size."""
    own = args.train == "own"
    full = FULL_OWN if own else FULL
    n, sets = len(registered()), len(full["data"])
    runs = n * sets * 2 * len(full["seeds"])
    names = {"digits": "digits", "mnist5k": "MNIST-5k (28x28)"}
    page = "--train own --out benchmarks/results/compare_own.json --md docs/results/own.md"
    return [
        "## Full grid",
        "",
        "```bash",
        "python benchmarks/compare.py --jobs 2 --threads 1 "
        + (page if own else "--out benchmarks/results/compare.json --md docs/results/common.md"),
        "```",
        "",
        f"{' and '.join(names[d] for d in full['data'])}, Dir 0.1 and 1.0, seeds 0-2, "
        f"{full['rounds']} rounds (`--rounds 100` for HtFLlib's length): {n} algorithms x "
        f"{sets} dataset{'s' if sets > 1 else ''} x 2 alphas x 3 seeds = {runs} runs. It "
        "resumes where it stopped (`--table-only` rewrites this page "
        "from the results file). The algorithms that average whole models (`fedavg`, `ccvr`) "
        "need one architecture: `--family homo_mlp --algorithms fedavg ccvr local` runs them on "
        "a homogeneous fleet.",
    ]


def demo_default() -> str:
    """The algorithm ``coordinator demo`` runs by default."""
    from coordinator.presets import load_preset

    return str(load_preset("demo").settings["algorithm"])


def grid_preset(args: argparse.Namespace) -> dict[str, Any]:
    """The setting ``args`` completes: the smoke one, else its recipe's full grid (``--train
    own``: digits only)."""
    if args.quick:
        return QUICK
    return FULL_OWN if args.train == "own" else FULL


def whole_grid(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the preset's datasets, alphas and seeds added to its own (in order)."""
    preset = grid_preset(args)
    data = [d for d in IMAGE_SIZE if d in {*preset["data"], *args.data}]
    alphas = sorted({*DEFAULT_ALPHAS, *args.alphas})
    seeds = sorted({*preset["seeds"], *args.seeds})
    return argparse.Namespace(**{**vars(args), "data": data, "alphas": alphas, "seeds": seeds})


def _describe(r: dict[str, Any]) -> str:
    return (
        f"personal={r['acc_personal']:.3f} global={r['acc_global']:.3f} "
        f"down/up={r['down_per_client'] / 1e3:.1f}/{r['up_per_client'] / 1e3:.1f} kB "
        f"s/round={r['s_per_round']:.1f} wall={r['wall_s']:.0f}s"
    )


def prepare(args: argparse.Namespace) -> None:
    """Merge ``--merge`` files into ``--out``; refuse algorithms that are not registered."""
    for other in args.merge:
        print(f"{merge_results(args.out, other)} runs added from {other}")
    unknown = sorted(set(args.algorithms or []) - set(registered()))
    if unknown:
        sys.exit(f"unknown algorithms {unknown}; registered: {registered()}")


def grid(
    args: argparse.Namespace, algorithms: list[str], at: argparse.Namespace
) -> list[dict[str, Any]]:
    """The specs of ``algorithms`` (those that apply to the fleet) over ``at``'s datasets,
    alphas and seeds."""
    return [
        run_spec(args, alg, data, alpha, seed)
        for data in at.data
        for alpha in at.alphas
        for seed in at.seeds
        for alg in algorithms
        if not_applicable(alg, args.family) is None
    ]


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """This call's runs, MNIST-5k and the slow algorithms first."""
    return schedule(grid(args, args.algorithms or registered(), args))


def tables(results: experiment.Results) -> str:
    """The page: every registered algorithm in this setting, whichever of them this call runs
    (an ablation's page: just its rows), and every dataset, alpha and seed of the preset's
    grid (a call for MNIST-5k alone keeps the digits tables)."""
    args = results.args
    shown = (args.algorithms or registered()) if args.hyper else registered()
    skipped = {a: why for a in shown if (why := not_applicable(a, args.family))}
    page_args = args if args.hyper else whole_grid(args)
    page_specs = grid(args, shown, page_args)
    # the page states one setting (a results file may hold more: other rounds, seeds, recipes)
    planned = {spec_key(s) for s in page_specs}
    return page(
        page_args,
        [r for r in results.runs if spec_key(r["spec"]) in planned],
        [f for f in results.failures if spec_key(f["spec"]) in planned],
        skipped,
        page_specs,
    )


EXPERIMENT = experiment.Experiment(
    description=__doc__ or "",
    preset=PRESET,
    plan=plan,
    execute=execute,
    describe=_describe,
    tables=tables,
    add_args=add_args,
    finish_args=finish_args,
    prepare=prepare,
    sim_run=sim_run,
    dirty=True,
    deadline=900.0,
)


if __name__ == "__main__":
    experiment.main(EXPERIMENT)
