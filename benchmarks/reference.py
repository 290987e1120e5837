"""The reference tier: every algorithm in HtFLlib's setting, on HtFLlib-style split files,
trained until its best round is ``--patience`` rounds old.

Setting: MNIST-5k at 28x28, 20 clients, the split files of ``benchmarks/splits/`` (Dirichlet 0.1
and 1.0, 75/25 per client, no global hold-out), the ``htfl_cnn`` family (HtFLlib's HCNNs4 for
one channel: 512-d pooled post-ReLU features, no projection), full participation, every
algorithm under ``run.preset = "htfllib"`` (HtFLlib's client recipe, SGD lr 0.01 batch 10 one
epoch, and ``total.sh``'s per-algorithm values; an algorithm without such a preset runs
HtFLlib's client recipe over its own defaults). Seeds vary the initialisation and batch order,
never the split. Training stops when the best round of the personalised accuracy is
``--patience`` rounds old, or at ``--rounds``.

Reported per algorithm and alpha, mean with a 95 % t interval over seeds, each on both metrics
(personalised: each client's model on its own test split, sample-weighted as HtFLlib reports
it; global: each client's model on the union of the clients' test splits, mean over clients):
the best round (HtFLlib's summary, optimistic) and the mean of the last 10 rounds; and the
paired difference from ``local`` on the same seeds. The global test set is scored every
``--global-every`` rounds only (it is the 20 clients' test splits together, and scoring it every
round took over half of each round's time): its best round is the best of those, its last-10
mean the mean of those among the last 10 rounds.

Usage::

    python benchmarks/reference.py --jobs 2 --threads 1      # the grid, resumable
    python benchmarks/reference.py --table-only              # rewrite the page only
    python benchmarks/reference.py --work-dir W --progress   # where a running grid stands
    python benchmarks/reference.py --preset edge             # the edge tier: family `tiny`

Settings, arms and split files: ``benchmarks/presets/reference.toml``; results in
``benchmarks/results/reference.json``, the page ``docs/results/reference.md``; the edge tier's
``benchmarks/results/edge_tier.json`` and ``docs/results/edge.md``.
"""

from __future__ import annotations

import argparse
import csv
import functools
import logging
import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import experiment
from experiment.summary import steps_failed
from harness import (
    ROOT,
    SimRun,
    ci95,
    ci_cell,
    host_label,
    paired_diffs,
    simulate_run,
    spec_key,
    split_test_sizes,
)

from coordinator import accuracy

logging.basicConfig(level=logging.ERROR)

PRESET = experiment.load_preset("reference")
METHODS = PRESET.arms
SPLITS: dict[str, str] = PRESET.other["splits"]
BASELINE: str = PRESET.other["report"]["baseline"]
CONTROLS: dict[str, str] = PRESET.other["report"].get("controls", {})
# a variant against the setting it changes (a seed method's paper, a baseline's default)
VARIANTS: dict[str, str] = PRESET.other["report"].get("variants", {})
PRESET_NAME = "htfllib"
LAST = 10  # the last rounds a run's second summary averages
TIER_CAP: int = PRESET.settings["rounds"]  # the tier's cap, which --preset long raises
KEYS = ("best_personal", "last_personal", "best_global", "last_global")
HTFLLIB: dict[str, Any] = PRESET.other["htfllib"]


def add_args(ap: argparse.ArgumentParser) -> None:
    """The script's own options (defaults: benchmarks/presets/reference.toml)."""
    ap.add_argument("--methods", nargs="+", choices=sorted(METHODS))
    ap.add_argument("--alphas", nargs="+", type=float, help="Dirichlet alpha (a split file each)")
    ap.add_argument("--family", help="models.families name")
    ap.add_argument("--rounds", type=int, help="the cap")
    ap.add_argument("--patience", type=int, help="stop once the best round is this old")
    ap.add_argument(
        "--global-every",
        type=int,
        help="score the global test set every N-th round (it is 20 clients' test splits: "
        "scoring it every round took over half of each round's time)",
    )
    ap.add_argument(
        "--device",
        help="where the agents train (cpu, cuda); not part of a run's identity in --out (a "
        "GPU's run fills the same row), but a run in --work-dir resumes on its own device only",
    )
    ap.add_argument(
        "--feature-dim",
        type=int,
        help="every agent's feature size (default: each network's own, unless the algorithm "
        "needs one); a family whose networks differ in it needs one for the prototype methods",
    )


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Seed by seed (a whole first seed before any second), alpha by alpha, method by method:
    an interrupted grid has every row at the same number of seeds."""
    return [
        run_spec(args, method, alpha, seed)
        for seed in args.seeds
        for alpha in args.alphas
        for method in args.methods
    ]


def run_spec(args: argparse.Namespace, method: str, alpha: float, seed: int) -> dict[str, Any]:
    """Everything that determines one run (also its identity in the results file)."""
    from protocol.algorithms import config_type
    from protocol.algorithms.base import HTFLLIB_TRAINING

    arm = METHODS[method]
    has_preset = PRESET_NAME in config_type(arm.algorithm).PRESETS
    return {
        "method": method,
        "algorithm": arm.algorithm,
        "preset": PRESET_NAME if has_preset else "",
        "hyper": {**({} if has_preset else HTFLLIB_TRAINING), **arm.hyper},
        "family": args.family,
        "alpha": alpha,
        "seed": seed,
        "split": SPLITS[f"{alpha:.1f}"],
        "rounds": args.rounds,
        "patience": args.patience,
        "global_every": args.global_every,
        # only when set, so that the runs of a family of native features keep their identity
        **({"feature_dim": args.feature_dim} if args.feature_dim else {}),
    }


def sim_run(spec: dict[str, Any], args: argparse.Namespace) -> SimRun:
    """The simulation of ``spec``."""
    from coordinator.config import load_config
    from models.families import family_models

    split = ROOT / spec["split"]
    clients = len(split_test_sizes(split))
    needs = load_config(
        None, [], algorithm=spec["algorithm"], preset=spec["preset"], run_dir=str(ROOT)
    ).replace(hyper=spec["hyper"])
    run = SimRun(
        algorithm=spec["algorithm"],
        hyper=spec["hyper"],
        seed=spec["seed"],
        rounds=spec["rounds"],
        clients=clients,
        models=tuple(family_models(spec["family"], clients)),
        data="mnist5k",
        partition_file=str(split),
        # native features (HtFLlib's 512-d) or the tier's size, unless the algorithm needs
        # another (FedKTL: its ETF's K dimensions; FedVTC: its generator's latent)
        feature_dim=needs.required_feature_dim() or spec.get("feature_dim"),
        global_test=0,
        deadline_s=args.deadline,
        max_retries=1,
        run_id="reference",
        device=args.device,
        preset=spec["preset"],
        patience=spec["patience"],
        global_eval_every=spec["global_every"],
    )
    return run


def execute(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One simulation on the split file, reduced to its two summaries on both metrics (the
    personalised one weighted by each client's test-split size)."""
    steps, wall = simulate_run(sim_run(spec, args), args.threads, args.work_dir)
    sizes = split_test_sizes(ROOT / spec["split"])
    host = host_label()
    return {
        "spec": spec,
        "wall_s": wall,
        "device": args.device,
        "host": host,
        **summarize(steps, sizes),
    }


def _weighted(agents: dict[str, Any], sizes: list[int]) -> float | None:
    """Sample-weighted personalised accuracy over the agents that reported (agentK holds
    ``sizes[K]`` test samples)."""
    return accuracy.personalised_accuracy(agents, {f"agent{k}": n for k, n in enumerate(sizes)})


def summarize(steps: list[dict[str, Any]], sizes: list[int]) -> dict[str, Any]:
    """Per training round both metrics; each one's best round and last-10 mean."""
    train = [s for s in steps if s["phase"] == "train" and s.get("quorum_met") is not False]
    personal = [_weighted(s["agents"], sizes) for s in train]
    glob = [accuracy.round_value(s, "acc_global") for s in train]  # the recorded mean
    out: dict[str, Any] = {
        "rounds_done": len(train),
        "steps_failed": steps_failed(steps),
        "curve_personal": personal,
        "curve_global": glob,
        "s_per_round": statistics.fmean(float(s["duration_s"]) for s in train) if train else None,
    }
    for name, curve in (("personal", personal), ("global", glob)):
        vals = [(i + 1, v) for i, v in enumerate(curve) if v is not None]
        best = max(vals, key=lambda p: p[1]) if vals else None
        out[f"best_{name}"] = None if best is None else best[1]
        out[f"best_round_{name}"] = None if best is None else best[0]
        # the values of the last LAST rounds run (the global set is scored every few rounds)
        tail = [v for r, v in vals if r > len(curve) - LAST]
        out[f"last_{name}"] = statistics.fmean(tail) if tail else None
    out.update(summarize_final(steps, sizes))
    return out


# what a final phase (FedVTC's fine-tuning on synthetic images) reports, by the suffix of its
# agents' metrics: after the phase, just before it, and its noise control (diagnostics=true)
FINAL_STAGES = {"final": "", "before_ft": "_before_ft", "noise_control": "_noise_control"}


def summarize_final(steps: list[dict[str, Any]], sizes: list[int]) -> dict[str, Any]:
    """Both metrics after the last ``final`` step, before it and on its noise control (none
    for an algorithm without a final phase). Personalised is weighted by the test splits, as in
    training rounds (the final step's ``num_samples`` counts synthetic samples)."""
    final = [s for s in steps if s["phase"] == "final" and s.get("quorum_met") is not False]
    if not final:
        return {}
    agents, out = final[-1]["agents"], {}
    weights = {f"agent{k}": n for k, n in enumerate(sizes)}
    for stage, suffix in FINAL_STAGES.items():
        personal = accuracy.personalised_accuracy(agents, weights, f"acc_local{suffix}")
        glob = accuracy.round_value(final[-1], f"acc_global{suffix}")
        if personal is not None or glob is not None:
            out[f"{stage}_personal"], out[f"{stage}_global"] = personal, glob
    return out


# ----- the page -------------------------------------------------------------------------------
HTFL_CNN = "HtFLlib's 1-channel CNN family `htfl_cnn` (512-d pooled features)"
# per named preset (None: the tier itself): the page's title, its networks, the command that
# fills it
TIERS: dict[str | None, tuple[str, str, str]] = {
    None: (
        "The reference tier: HtFLlib's setting",
        HTFL_CNN,
        "python benchmarks/reference.py --jobs 2 --threads 1",
    ),
    "long": (
        "The reference tier, trained longer",
        HTFL_CNN,
        "python benchmarks/reference.py --preset long --jobs 2 --threads 1",
    ),
    "edge": (
        "The edge tier: the reference setting on the `tiny` family",
        "the toolkit's edge family `tiny` (five BN-free networks of 55k-204k parameters, "
        "features a 64-d linear projection)",
        "python benchmarks/reference.py --preset edge --jobs 2 --threads 1",
    ),
}


def _shown(path: str | Path) -> str:
    """A results file as the page names it: relative to the repository when inside it."""
    full = Path(path).resolve()
    return str(full.relative_to(ROOT)) if full.is_relative_to(ROOT) else full.name


def _cell(vals: Sequence[float | None]) -> str:
    xs = [v for v in vals if v is not None]
    if not xs:
        return "–"
    mean, half = ci95(xs)
    return f"{100 * mean:.2f}" if math.isnan(half) else f"{100 * mean:.2f} ± {100 * half:.2f}"


_diff = functools.partial(ci_cell, digits=2)


def _diff_row(by: dict[str, dict[int, dict[str, Any]]], method: str, other: str) -> str:
    """A paired-difference row ``method`` − ``other`` over the seeds both ran ('' if none)."""
    seeds = len(set(by.get(method, {})) & set(by.get(other, {})))
    if not seeds:
        return ""
    rs, base = list(by[method].values()), list(by[other].values())
    cols = " | ".join(_diff(paired_diffs(rs, base, k)) for k in KEYS)
    return f"| `{method}` − `{other}` | {seeds} | {cols} |"


def tables(results: experiment.Results) -> str:
    """Markdown: per alpha, the accuracy table and the paired differences from ``local``."""
    groups: dict[float, dict[str, dict[int, dict[str, Any]]]] = {}
    for r in results.runs:
        s = r["spec"]
        groups.setdefault(s["alpha"], {}).setdefault(s["method"], {})[s["seed"]] = r
    codes = sorted({str(r.get("code", "?")) for r in results.runs})
    title, networks, command = TIERS[results.args.preset]
    caps, patience = (
        _values(r["spec"].get(k) for r in results.runs) for k in ("rounds", "patience")
    )
    out: list[str] = [
        f"# {title}",
        "",
        "MNIST-5k (28x28), 20 clients, the split files of `benchmarks/splits/` (Dirichlet 1.0 "
        "and 0.1, 75/25 per client, no global hold-out: the global test set is the union of "
        f"the clients' test splits), {networks}, every algorithm under "
        '`run.preset = "htfllib"` (HtFLlib\'s client '
        "recipe, SGD lr 0.01, batch 10, one epoch, and `total.sh`'s values), trained until "
        f"its best round (personalised) is {patience or '`patience`'} rounds old or the "
        f"round cap ({caps or '`rounds`'} rounds); seeds vary the start and batch order, never "
        "the split. "
        f"Code {', '.join(codes) or '–'}. Produced by `{command}` (results: "
        f"`{_shown(results.args.out)}`); HtFLlib's own runs on the same files: "
        "`benchmarks/htfllib/`.",
        "",
    ]
    done = {spec_key(r["spec"]) for r in results.runs}
    missing = [s for s in results.specs if spec_key(s) not in done]
    if missing:  # a grid still running: every figure below is provisional
        out += [
            f"**Provisional**: {len(results.specs) - len(missing)} of the {len(results.specs)} "
            f"planned runs are done; {len(missing)} to go (the grid resumes where it stopped).",
            "",
        ]
    for alpha, by in sorted(groups.items(), key=lambda kv: -kv[0]):
        own = results.args.family == "htfl_cnn"  # HtFLlib ran its own networks, not ours
        out += [f"### MNIST-5k, Dirichlet {alpha:g}", "", *glance(alpha, by, own), ""]
        out += [
            "Accuracy, % (mean ± 95 % t half-width over seeds). Best = the run's best round "
            "(HtFLlib's summary); last 10 = the mean of its last 10 rounds. The global test set "
            "is scored every few rounds only (`global_every` in the results file): its "
            "figures are over those rounds. Best round: where the personalised best fell; a "
            "run that stopped at the cap with its best round less than `patience` rounds "
            "before it was still improving. Late gain: the personalised mean of the last 10 "
            "rounds run minus that of the 10 before them, points [95 % t interval].",
            "",
            "| method | seeds | rounds run | best round | personalised, best | "
            "personalised, last 10 | global, best | global, last 10 | late gain | s/round |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for m in (m for m in METHODS if m in by):
            rs = list(by[m].values())
            cells = " | ".join(_cell([r.get(k) for r in rs]) for k in KEYS)
            rounds = _span([r["rounds_done"] for r in rs])
            best = _span([r.get("best_round_personal") for r in rs])
            gains = [g for r in rs if (g := _late_gain(r)) is not None]
            late = _diff(gains) if gains else "–"
            per_round = statistics.fmean(r["s_per_round"] or 0.0 for r in rs)
            out.append(
                f"| `{m}` | {len(rs)} | {rounds} | {best} | {cells} | {late} | {per_round:.1f} |"
            )
        pairs = [(m, BASELINE) for m in METHODS if m in by and m != BASELINE]
        pairs += [(m, control) for m, control in CONTROLS.items() if m in by]
        pairs += [(m, paper) for m, paper in VARIANTS.items() if m in by]
        rows = [row for m, other in pairs if (row := _diff_row(by, m, other))]
        if rows:
            out += [
                "",
                f"Paired differences, points (mean [95 % t interval]; same seed = same split, "
                f"start and batch order): from `{BASELINE}`, then each seed method from its own "
                "control (the same method without its exchange), then each variant from the "
                "setting it changes (the paper's, or a baseline's default):",
                "",
                "| comparison | seeds | personalised, best | personalised, last 10 | "
                "global, best | global, last 10 |",
                "|---|---|---|---|---|---|",
                *rows,
            ]
        out += final_phase(by)
        out += past_the_cap(by)
        if own:
            out += parity(alpha, by)
        out.append("")
    return "\n".join(out)


def past_the_cap(by: dict[str, dict[int, dict[str, Any]]]) -> list[str]:
    """What rounds beyond the tier's cap added, within each run: its best round minus its best
    in the first :data:`TIER_CAP` rounds (none for runs capped there). Within one run, so it
    holds the start, batch order, code and machine fixed: runs of one spec made on different
    machines need not agree to the bit (the tier's FedGH runs and their reruns part by one
    test sample from round 9), and comparing with the tier's own runs would mix that in."""
    rows = []
    for m in (m for m in METHODS if m in by):
        rs = [r for r in by[m].values() if (r["spec"].get("rounds") or 0) > TIER_CAP]
        if not rs:
            continue
        firsts = [max(v for v in r["curve_personal"][:TIER_CAP] if v is not None) for r in rs]
        bests = [r["best_personal"] for r in rs]
        gains = [best - first for best, first in zip(bests, firsts, strict=True)]
        past = sum(r["rounds_done"] > TIER_CAP for r in rs)
        # with two or three seeds the interval says little: each run's own gain and its reach
        each = " · ".join(
            f"{r['spec']['seed']}: {100 * gain:+.2f} (best r{r['best_round_personal']} "
            f"of {r['rounds_done']})"
            for r, gain in sorted(zip(rs, gains, strict=True), key=lambda p: p[0]["spec"]["seed"])
        )
        rows.append(
            f"| `{m}` | {len(rs)} | {past} | {_cell(firsts)} | {_cell(bests)} | {_diff(gains)} "
            f"| {each} |"
        )
    if not rows:
        return []
    return [
        "",
        f"Past the tier's cap: each run's best round against its own best in the first "
        f"{TIER_CAP} rounds (personalised, %; the gain in points [95 % t interval]); a run "
        f"that stopped by patience before round {TIER_CAP} gains nothing:",
        "",
        f"| method | seeds | ran past {TIER_CAP} | best, first {TIER_CAP} rounds | "
        "best, all rounds | gain | each seed: gain (best round of rounds run) |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]


def glance(alpha: float, by: dict[str, dict[int, dict[str, Any]]], htfllib: bool) -> list[str]:
    """Markdown: each method's headline figures beside its paired difference from the
    baseline, and (``htfllib``) HtFLlib's own run of it on the same split (the tables below
    have the rest)."""
    base = list(by.get(BASELINE, {}).values())
    htfl_best = {
        arm: statistics.fmean(curve_summary(c)[0] for c in curves)
        for algo, arm in htfllib_pairs()
        if htfllib and (curves := htfllib_curves(alpha).get(algo))
    }
    rows = []
    for m in (m for m in METHODS if m in by):
        rs = list(by[m].values())
        cells = []
        for key in ("best_personal", "last_global"):
            diffs = paired_diffs(rs, base, key) if m != BASELINE else []
            cells += [_cell([r.get(key) for r in rs]), _diff(diffs) if diffs else "–"]
        if htfllib:
            cells.append(f"{100 * htfl_best[m]:.2f}" if m in htfl_best else "–")
        rows.append(f"| `{m}` | {len(rs)} | {' | '.join(cells)} |")
    head = (
        f"| method | seeds | personalised, best | − `{BASELINE}` | global, last 10 | "
        f"− `{BASELINE}` |"
    )
    return [
        f"At a glance: accuracy, % (mean ± 95 % t half-width over seeds), and the paired "
        f"difference from `{BASELINE}`, points [95 % t interval]"
        + ("; HtFLlib's own run on the same split, its best round." if htfllib else "."),
        "",
        head + (" HtFLlib, best |" if htfllib else ""),
        "|---|---|---|---|---|---|" + ("---|" if htfllib else ""),
        *rows,
    ]


def final_phase(by: dict[str, dict[int, dict[str, Any]]]) -> list[str]:
    """Markdown: the methods with a final phase, before and after it and against its noise
    control, with paired differences (the model it starts from is the last training round's,
    not the best round's). Every algorithm's last step scores its model: a final phase is one
    whose agents also report the model from before it."""
    methods = [m for m in METHODS if any("before_ft_personal" in r for r in by.get(m, {}).values())]
    if not methods:
        return []
    out = [
        "",
        "Methods with a final phase (FedVTC: every device fine-tunes on images its averaged "
        "generator decodes from the global prototypes), accuracy % on both metrics: just "
        "before the phase (the last training round's model), after it, and the noise control "
        "(the same model fine-tuned on uniform noise with the same labels and schedule); then "
        "paired differences, points:",
        "",
        "| method | seeds | before, personalised | after, personalised | noise control, "
        "personalised | before, global | after, global | noise control, global |",
        "|---|---|---|---|---|---|---|---|",
    ]
    diffs = []
    for m in methods:
        rs = [r for r in by[m].values() if "before_ft_personal" in r]
        cells = [
            _cell([r.get(f"{stage}_{metric}") for r in rs])
            for metric in ("personal", "global")
            for stage in ("before_ft", "final", "noise_control")
        ]
        out.append(f"| `{m}` | {len(rs)} | {' | '.join(cells)} |")
        others = [
            ("before", rs, "before_ft"),
            ("noise control", rs, "noise_control"),
            (f"`{BASELINE}` last 10", list(by.get(BASELINE, {}).values()), "last"),
        ]
        if m in VARIANTS:
            paper = VARIANTS[m]
            others.append((f"`{paper}` after", list(by.get(paper, {}).values()), "final"))
        for label, other, key in others:
            cols = [
                paired_diffs(rs, other, f"final_{metric}", f"{key}_{metric}")
                for metric in ("personal", "global")
            ]
            if any(cols):
                shown = " | ".join(_diff(c) if c else "–" for c in cols)
                diffs.append(f"| `{m}`: after − {label} | {max(map(len, cols))} | {shown} |")
    return [
        *out,
        "",
        "| comparison | seeds | personalised | global |",
        "|---|---|---|---|",
        *diffs,
    ]


# ----- HtFLlib on the same split files --------------------------------------------------------
Curve = list[tuple[int, float]]


def htfllib_curves(alpha: float) -> dict[str, list[Curve]]:
    """HtFLlib's personalised accuracy per round on the split of ``alpha`` (the TSV of
    ``benchmarks/htfllib/run_reference.sh``): algorithm -> one curve per run."""
    path = ROOT / HTFLLIB["runs"].format(alpha=f"{alpha:.1f}")
    runs: dict[str, dict[str, Curve]] = {}
    if path.exists():
        with path.open(newline="") as fh:
            for row in csv.DictReader(fh, delimiter="\t"):
                curve = runs.setdefault(row["algorithm"], {}).setdefault(row["run"], [])
                curve.append((int(row["round"]), float(row["accuracy"])))
    return {algo: [sorted(c) for c in by_run.values()] for algo, by_run in runs.items()}


def htfllib_pairs() -> list[tuple[str, str]]:
    """(HtFLlib algorithm, our arm) for each arm that matches one of its algorithms: the
    preset's ``[htfllib.arms]`` gives one arm or a list (our default and the arm run as
    HtFLlib runs it)."""
    return [
        (algo, arm)
        for algo, arms in HTFLLIB["arms"].items()
        for arm in ([arms] if isinstance(arms, str) else arms)
    ]


def curve_summary(curve: Curve) -> tuple[float, float, int]:
    """Best round after training began (round 0 is the untrained start), the mean of the last
    ``LAST`` rounds, and the last round."""
    trained = [a for r, a in curve if r >= 1]
    return max(trained), statistics.fmean(trained[-LAST:]), curve[-1][0]


def parity(alpha: float, by: dict[str, dict[int, dict[str, Any]]]) -> list[str]:
    """Markdown: HtFLlib's own runs on this split beside our matching arm, on its metric."""
    curves = htfllib_curves(alpha)
    rows = []
    for algo, arm in htfllib_pairs():
        if not curves.get(algo):
            continue
        sums = [curve_summary(c) for c in curves[algo] if any(r >= 1 for r, _ in c)]
        if not sums:
            continue
        ours = list(by.get(arm, {}).values())
        best = [b for b, _, _ in sums]
        last = [m for _, m, _ in sums]
        mine_best = [r["best_personal"] for r in ours if r.get("best_personal") is not None]
        mine_last = [r["last_personal"] for r in ours if r.get("last_personal") is not None]
        gap = (
            f"{100 * (statistics.fmean(mine_best) - statistics.fmean(best)):+.2f}"
            if mine_best
            else "–"
        )
        rounds = "–".join(str(n) for n in sorted({s[2] for s in sums}))
        rows.append(
            f"| {algo} | `{arm}` | {len(sums)} / {len(ours)} | {rounds} | {_cell(best)} | "
            f"{_cell(last)} | {_cell(mine_best)} | {_cell(mine_last)} | {gap} |"
        )
    if not rows:
        return []
    return [
        "",
        "HtFLlib itself on the same split file (`benchmarks/htfllib/run_reference.sh`, "
        f"`{HTFLLIB['runs'].format(alpha=f'{alpha:.1f}')}`), on its metric: each client's model "
        "on its own test split, correct / samples over all clients (our personalised figure). "
        "HtFLlib runs a fixed number of rounds; ours stop when the best round is `patience` "
        "rounds old. HtFLlib's FD takes the softmax of the averaged logits as its targets, as "
        "its 2024-2025 versions do (the pinned commit feeds the raw logits to the cross-entropy "
        "and diverges to NaN); every change to HtFLlib is listed in `benchmarks/htfllib/`.",
        "",
        "| HtFLlib | ours | runs (HtFLlib / ours) | HtFLlib rounds | HtFLlib best | "
        "HtFLlib last 10 | ours best | ours last 10 | best: ours − HtFLlib |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def _late_gain(run: dict[str, Any]) -> float | None:
    """The run's personalised late gain (its curve scores every round)."""
    curve = run.get("curve_personal") or []
    return accuracy.late_gain([v for v in curve if v is not None], LAST)


def _values(values: Iterable[int | None]) -> str:
    """The distinct known ``values``, "100" or "100, 300" ('' if none is known)."""
    return ", ".join(str(v) for v in sorted({v for v in values if v is not None}))


def _span(values: list[int | None]) -> str:
    """The range of ``values`` over seeds, "41–70", or the one value; "–" if none is known."""
    known = sorted({v for v in values if v is not None})
    return "–".join(str(v) for v in sorted({known[0], known[-1]})) if known else "–"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.2f}"


def _describe(r: dict[str, Any]) -> str:
    return (
        f"best {_pct(r['best_personal'])} (r{r['best_round_personal']}) "
        f"last10 {_pct(r['last_personal'])} global {_pct(r['last_global'])} "
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
