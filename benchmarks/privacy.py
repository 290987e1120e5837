"""Accuracy against the privacy budget: each device's ``hyper.dp.epsilon`` over the run for the
algorithms whose replies are per-class sums, ``local`` (nothing leaves the device) as the floor.

Setting: the reference tier's (``benchmarks/reference.py``): MNIST-5k at 28x28, 20 clients, the
Dirichlet 1.0 split file, the ``htfl_cnn`` family, full participation, each algorithm under
``run.preset = "htfllib"`` where it has one (HtFLlib's client recipe otherwise), a fixed number
of rounds (the budget is calibrated for that many releases: ``hyper.dp.releases`` = rounds).
Epsilon 0 is differential privacy off (infinite epsilon), at ``delta`` 1e-5 and ``clip`` 1.0.

Reported per method and epsilon, mean with a 95 % t interval over seeds: the personalised
accuracy (each client's model on its own test split, sample-weighted) of the best round and the
mean of the last 10 rounds, and the global one's last 10; and the paired difference of each
method from ``local`` on the same seeds.

Usage::

    python benchmarks/privacy.py --jobs 2 --threads 1        # the grid, resumable
    python benchmarks/privacy.py --table-only                # rewrite the page only
    python benchmarks/privacy.py --rounds 2 --seeds 1 --out /tmp/p.json --md /tmp/p.md  # smoke

Settings and arms: ``benchmarks/presets/privacy.toml``; results in
``benchmarks/results/privacy.json``, the page ``docs/results/privacy.md``.
"""

from __future__ import annotations

import argparse
import logging
import math
from typing import Any

import experiment
from harness import (
    ROOT,
    SimRun,
    ci95,
    ci_cell,
    paired_diffs,
    simulate_run,
    spec_key,
    split_test_sizes,
)
from reference import summarize

logging.basicConfig(level=logging.ERROR)

PRESET = experiment.load_preset("privacy")
METHODS = PRESET.arms
BASELINE = "local"
PRESET_NAME = "htfllib"
OFF = 0.0  # hyper.dp.epsilon 0: differential privacy off


def add_args(ap: argparse.ArgumentParser) -> None:
    """The script's own options (defaults: benchmarks/presets/privacy.toml)."""
    ap.add_argument("--methods", nargs="+", choices=sorted(METHODS))
    ap.add_argument("--epsilons", nargs="+", type=float, help="budgets; 0 = off (infinite)")
    ap.add_argument("--clip", type=float, help="hyper.dp.clip")
    ap.add_argument("--family", help="models.families name")
    ap.add_argument("--split", help="the split file")
    ap.add_argument("--rounds", type=int, help="rounds (and the releases the budget covers)")
    ap.add_argument("--global-every", type=int, help="score the global test set every N rounds")
    ap.add_argument("--device", help="where the agents train; not part of a run's identity")


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Seed by seed, epsilon by epsilon, method by method; ``local`` sends nothing, so it runs
    once a seed, without a budget."""
    return [
        run_spec(args, method, epsilon, seed)
        for seed in args.seeds
        for epsilon in args.epsilons
        for method in args.methods
        if method != BASELINE or epsilon == OFF
    ]


def run_spec(args: argparse.Namespace, method: str, epsilon: float, seed: int) -> dict[str, Any]:
    """Everything that determines one run (also its identity in the results file)."""
    from protocol.algorithms import config_type
    from protocol.algorithms.base import HTFLLIB_TRAINING

    arm = METHODS[method]
    has_preset = PRESET_NAME in config_type(arm.algorithm).PRESETS
    hyper = dict(arm.hyper)
    clip = hyper.pop("dp_clip", args.clip)  # an arm's own clip outranks --clip
    dp = {"dp_epsilon": epsilon, "dp_clip": clip} if epsilon != OFF else {}
    return {
        "method": method,
        "algorithm": arm.algorithm,
        "preset": PRESET_NAME if has_preset else "",
        "hyper": {**({} if has_preset else HTFLLIB_TRAINING), **hyper, **dp},
        "epsilon": epsilon,
        "family": args.family,
        "seed": seed,
        "split": args.split,
        "rounds": args.rounds,
        "global_every": args.global_every,
    }


def feature_dim(spec: dict[str, Any]) -> int | None:
    """The feature size the run's algorithm requires of every model (FedKTL: its ETF's K),
    None for the family's native one; validates the run's config (``hyper.dp`` included)."""
    from coordinator.config import load_config

    needs = load_config(
        None, [], algorithm=spec["algorithm"], preset=spec["preset"], run_dir=str(ROOT)
    ).replace(hyper=spec["hyper"])
    return needs.required_feature_dim() or None


def sim_run(spec: dict[str, Any], args: argparse.Namespace) -> SimRun:
    """The simulation of ``spec``."""
    from models.families import family_models

    split = ROOT / spec["split"]
    sizes = split_test_sizes(split)
    return SimRun(
        algorithm=spec["algorithm"],
        hyper=spec["hyper"],
        seed=spec["seed"],
        rounds=spec["rounds"],
        clients=len(sizes),
        models=tuple(family_models(spec["family"], len(sizes))),
        data="mnist5k",
        partition_file=str(split),
        feature_dim=feature_dim(spec),
        global_test=0,
        deadline_s=args.deadline,
        max_retries=1,
        run_id="privacy",
        device=args.device,
        preset=spec["preset"],
        global_eval_every=spec["global_every"],
    )


def execute(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One simulation on the split file, reduced like the reference tier's."""
    steps, wall = simulate_run(sim_run(spec, args), args.threads, args.work_dir)
    sizes = split_test_sizes(ROOT / spec["split"])
    return {"spec": spec, "wall_s": wall, "device": args.device, **summarize(steps, sizes)}


# ----- the page -------------------------------------------------------------------------------
KEYS = {"best_personal": "personalised, best", "last_personal": "personalised, last 10",
        "last_global": "global, last 10"}  # fmt: skip


def _label(epsilon: float) -> str:
    return "∞ (off)" if epsilon == OFF else f"{epsilon:g}"


def _cell(vals: list[float | None]) -> str:
    xs = [v for v in vals if v is not None]
    if not xs:
        return "–"
    mean, half = ci95(xs)
    return f"{100 * mean:.2f}" if math.isnan(half) else f"{100 * mean:.2f} ± {100 * half:.2f}"


def tables(results: experiment.Results) -> str:
    """Markdown: per metric, methods by epsilon; then the paired differences from ``local``."""
    by: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in results.runs:
        by.setdefault((r["spec"]["method"], r["spec"]["epsilon"]), []).append(r)
    epsilons = sorted({e for _, e in by}, key=lambda e: math.inf if e == OFF else e)
    methods = [m for m in METHODS if any(k[0] == m for k in by)]
    codes = sorted({str(r.get("code", "?")) for r in results.runs})
    head = "| method | " + " | ".join(f"ε = {_label(e)}" for e in epsilons) + " |"
    rule = "|---|" + "---|" * len(epsilons)
    out = [
        "# Accuracy against the privacy budget",
        "",
        "Each device's budget `hyper.dp.epsilon` over the run (delta 1e-5, clip 1.0 where an arm "
        "sets no `dp_clip`, spread "
        "over the run's rounds; FedKTL's unit embeddings are bounded by 1 whatever the clip), "
        "in the reference tier's setting: MNIST-5k (28x28), 20 "
        "clients, the Dirichlet 1.0 split file, `htfl_cnn`, the `htfllib` preset where the "
        "algorithm has one. `local` sends nothing (the floor). Accuracy, % (mean ± 95 % t "
        f"half-width over seeds). Code {', '.join(codes) or '–'}. Produced by "
        "`python benchmarks/privacy.py --jobs 2 --threads 1` (results: "
        "`benchmarks/results/privacy.json`).",
        "",
    ]
    done = {spec_key(r["spec"]) for r in results.runs}
    planned = sum(spec_key(s) in done for s in results.specs)  # single-seed diagnostics aside
    if planned < len(results.specs):
        out += [f"**Provisional**: {planned} of the {len(results.specs)} planned runs done.", ""]
    out += ["Arms (`benchmarks/presets/privacy.toml`): " + "; ".join(map(_arm, methods)) + ".", ""]
    for key, title in KEYS.items():
        out += [f"### {title}", "", head, rule]
        for m in methods:
            cells = " | ".join(_cell([r.get(key) for r in by.get((m, e), [])]) for e in epsilons)
            out.append(f"| `{m}` | {cells} |")
        out.append("")
    base = by.get((BASELINE, OFF), [])
    rows = []
    for m in (m for m in methods if m != BASELINE and base):
        cols = [
            ci_cell(paired_diffs(rs, base, "last_personal"), digits=2) if rs else "–"
            for rs in (by.get((m, e), []) for e in epsilons)
        ]
        rows.append(f"| `{m}` − `{BASELINE}` | " + " | ".join(cols) + " |")
    if rows:
        out += [
            f"Paired difference from `{BASELINE}`, personalised last 10, points (mean [95 % t "
            "interval]; same seed = same split, start and batch order):",
            "",
            head.replace("| method |", "| comparison |"),
            rule,
            *rows,
            "",
        ]
    return "\n".join([*out, noise_table(results)])


def _arm(method: str) -> str:
    arm = METHODS[method]
    hyper = ", ".join(f"{k} = {v!r}" for k, v in arm.hyper.items())
    return f"`{method}`: {arm.algorithm}" + (f" ({hyper})" if hyper else "")


def noise_table(results: experiment.Results) -> str:
    """Markdown: what each budget's noise leaves of a class mean, from the accountant and the
    split alone (no training). A class sum of n samples clipped to C has norm at most n * C
    and noise of norm about z * C * sqrt(d); the ratio of the two is the best case
    signal-to-noise of the mean. For the server's mean over the devices holding a class: the
    plain mean of their means (FedProto) has noise sqrt(sum 1/n_k^2) / K times a device's
    z * C * sqrt(d), the pooled mean by count sqrt(K) / sum n_k times it."""
    import numpy as np

    from edge_agent.data import load_dataset, load_partition_file
    from edge_agent.dp import noise_multiplier
    from models import create_model
    from models.families import family_models

    spec = next(iter(results.specs), None)
    if spec is None:
        return ""
    split = load_partition_file(ROOT / spec["split"])
    labels = load_dataset("mnist5k").y
    table = np.stack([np.bincount(labels[idx], minlength=10) for idx in split.train])
    held = [table[:, c][table[:, c] > 0].astype(np.float64) for c in range(table.shape[1])]
    n = float(np.median(np.concatenate(held)))
    # the server's mean per class, in units of one sample's noise norm z * C * sqrt(d)
    plain = np.median([len(h) / math.sqrt(float((1 / h**2).sum())) for h in held])
    pooled = np.median([float(h.sum()) / math.sqrt(len(h)) for h in held])
    first = family_models(spec["family"], 1)[0]
    dim = create_model(first, num_classes=10, in_chans=1, input_size=28).num_features
    rounds = spec["rounds"]
    rows = []
    for eps in sorted({s["epsilon"] for s in results.specs} - {OFF}):
        z = noise_multiplier(eps, 1e-5, rounds, 2)  # FedProto's release: sums and counts
        unit = z * math.sqrt(dim)
        rows.append(
            f"| {eps:g} | {z:.2f} | {n / unit:.3f} | {plain / unit:.3f} | {pooled / unit:.3f} |"
        )
    return "\n".join(
        [
            "### What the noise leaves of a class mean",
            "",
            f"From the accountant and the split file alone: each device releases its class "
            f"sums and counts {rounds} times (FedProto: 2 Gaussian mechanisms a release, delta "
            f"1e-5) with noise multiplier z. A class sum of n samples clipped to C has norm at "
            f"most n * C, its noise about z * C * sqrt(d) in d = {dim} dimensions "
            f"(`{spec['family']}`'s features): n / (z sqrt(d)) is the best case signal-to-noise "
            f"ratio of the mean. Per budget, that ratio for the split's median class on a "
            f"device (n = {n:g} training samples), and (median over classes) for the server's "
            "mean over the devices holding a class: FedProto's plain mean of their means, "
            'and the pooled mean by count (`hyper.proto_weighting = "count"`), where a '
            "device's mean of a few samples weighs only those samples.",
            "",
            "| ε | z | one device | server, plain mean | server, by count |",
            "|---|---|---|---|---|",
            *rows,
            "",
            "A ratio below 1 is a prototype that is mostly noise. FedProto's regulariser "
            "pulls each device's features towards the server's prototypes, and under the "
            "`htfllib` preset it also predicts by the nearest of them: both rest on that "
            "ratio.",
            "",
        ]
    )


def _describe(r: dict[str, Any]) -> str:
    s = r["spec"]
    best = r["best_personal"]
    return (
        f"eps {_label(s['epsilon'])}: best {'–' if best is None else f'{100 * best:.2f}'} "
        f"{r['rounds_done']} rounds ({r['wall_s']:.0f} s)"
    )


EXPERIMENT = experiment.Experiment(
    description=__doc__ or "",
    preset=PRESET,
    plan=plan,
    execute=execute,
    describe=_describe,
    tables=tables,
    add_args=add_args,
    sim_run=sim_run,
)


if __name__ == "__main__":
    experiment.main(EXPERIMENT)
