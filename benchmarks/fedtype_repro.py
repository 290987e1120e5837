"""FedType at CPU scale: the reproduction of ``shared/specs/fedtype.md`` §10.

Every run goes through :func:`coordinator.sim.simulate.simulate` (the in-memory transport, the same
code paths as a real fleet), so accuracies are what the agents report and bytes are what the
coordinator's endpoint counted.

Setting (spec §10, defaults of this script): ``digits`` (8x8 grey), N = 10 agents, private pool
family ``fedtype_tiny`` (client i gets ``mlp_xl, mlp_w, cnn_fc, cnn_bn3``[i mod 4]), proxy
``mlp_xs`` (64->32->10, 2,410 parameters), Dir(alpha) label skew, a 360-image global test set,
per-client split 6:2:2 (test_fraction 0.2 of the partition, then ``val_fraction`` 0.25 of the
rest held out for calibration), T = 40 rounds, participation 0.5 (the coordinator's seeded
choice, identical for every method of one seed), R = 5 local epochs, batch 16, Adam lr 1e-3,
weight decay 1e-4, theta 0.1, lambda 0.5, kappa_reg 2 (§10: with sets of 1-2 labels kappa_reg 5
makes g inert; ``fedtype_k5`` is the paper's 5). ``--data mnist5k`` runs the same on the
5000-image MNIST subset at 28x28.

Methods (``METHODS``; every FedType arm is the registered ``fedtype`` with overrides):

* ``fedtype``: conformal BKD, consensus eta, g piecewise linear (the paper's method).
* ``fedtype_topk``: S = top-3 labels of the proxy (FedType_TopK).
* ``fedtype_sym``: BKD replaced by KL(softmax p || softmax w), proxy as teacher (FedType_sym).
* ``fedtype_eta1``: eta = 1 (FedType_eta=1).
* ``fedtype_glam``: g = lambda, constant (FedType_g=lambda).
* ``fedtype_k5``: FedType with kappa_reg = 5 (the paper's value).
* ``fedtype_pairwise`` / ``fedtype_meanset``: FedType with ``bkd_form = "pairwise"`` /
  ``bkd_reduction = "mean_over_set"`` (§4.3's flags; diagnostics of the BKD loss's form).
* ``fedtype_nobkd``: the control for what the proxy gives the private model: FedType with
  ``theta`` 0.001, so the calibration split is always too small (k > n) and BKD is skipped every
  epoch; the private model trains on CE alone on exactly FedType's D_i (60 % of the client's
  data), the proxy co-trains and is averaged as usual.
* ``fml``: FML-style mutual KD: the ``fedtype_sym`` loss (CE + KL both ways, weight 1, a shared
  FedAvg-averaged "meme" model = the proxy) but with no calibration split held out
  (``val_fraction`` 0.01: the private model and the proxy train on ~99 % of the training data,
  as in FML; the calibration it would do is skipped as too small and symmetric KD never uses it).
* ``local``: the private models trained with CE alone on their whole training split (80 % of the
  client's data, i.e. more than FedType's 60 %), no communication.
* ``fedavg_proxy``: plain FedAvg of the proxy architecture ``mlp_xs`` alone (every agent's model is
  the proxy), trained on the whole training split. Its ``final`` accuracy is p_g^T (FedAvg's final
  step loads the global model), i.e. the counterpart of FedType's ``global_proxy_acc``.

Usage::

    python benchmarks/fedtype_repro.py --alphas 0.5 --seeds 0 1 2 \\
        --out benchmarks/results/fedtype_digits.json --md benchmarks/results/fedtype_digits.md
    python benchmarks/fedtype_repro.py --out benchmarks/results/fedtype_digits.json --table-only

Settings, arms and compared pairs: ``benchmarks/presets/fedtype.toml`` (``--preset mnist5k``:
the MNIST-5k grid). Results are appended to ``--out`` after every run; a rerun skips runs
already there with the same settings, so an interrupted grid resumes. A run that raises is
recorded under ``failures`` (with its traceback) and retried by the next invocation.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
from typing import Any

import experiment
from experiment.summary import by_method, bytes_by_kind, paired_rows, per_arch, steps_failed
from harness import (
    IMAGE_SIZE,
    SimRun,
    final_step,
    mean_cell,
    mean_of,
    mean_sd,
    simulate_run,
    step_bytes,
    train_steps,
)

# the in-process transport's agents and the coordinator log per step (and FedType warns about
# small calibration splits at every epoch); the grid prints a line per run instead
logging.basicConfig(level=logging.ERROR)

PRESET = experiment.load_preset("fedtype")
METHODS = PRESET.arms
# headline paired comparisons (a - b), percentage points, on the private models' accuracy
PAIRS = PRESET.pairs()
# per-agent metrics averaged over a round's participants and kept per round in the JSON
ROUND_KEYS = (
    "acc_local",
    "acc_global",
    "proxy_acc",
    "global_proxy_acc",
    "mean_eta",
    "mean_set_size",
    "mean_private_set_size",
    "g_mean",
    "delta_first",
)


def add_args(ap: argparse.ArgumentParser) -> None:
    """The script's own options (defaults: benchmarks/presets/fedtype.toml)."""
    ap.add_argument("--data", choices=sorted(IMAGE_SIZE))
    ap.add_argument("--clients", type=int, help="N")
    ap.add_argument("--family", help="models.families name")
    ap.add_argument("--proxy", help="proxy architecture (registry name)")
    ap.add_argument("--rounds", type=int, help="T (paper: 100)")
    ap.add_argument("--fraction", type=float, help="participation (paper: 0.2)")
    ap.add_argument("--epochs", type=int, help="R, local epochs per participation")
    ap.add_argument("--lr", type=float, help="Adam lr (paper: 1e-4, §10: 1e-3)")
    ap.add_argument("--weight-decay", type=float)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--val-fraction", type=float, help="6:2:2 split (§10)")
    ap.add_argument("--k-reg", type=int, help="kappa_reg (paper 5; §10: 5 or 2)")
    ap.add_argument("--global-test", type=int)


def run_spec(args: argparse.Namespace, method: str, alpha: float, seed: int) -> dict[str, Any]:
    """Everything that determines one run (also its identity in the results file)."""
    algorithm = METHODS[method].algorithm
    hyper: dict[str, Any] = {
        "local_epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "optimizer": "adam",
    }
    if algorithm == "fedtype":
        hyper.update(proxy_model=args.proxy, val_fraction=args.val_fraction, raps_k_reg=args.k_reg)
    hyper.update(METHODS[method].hyper)
    return {
        "method": method,
        "algorithm": algorithm,
        "data": args.data,
        # fedavg_proxy: every agent's model is the proxy architecture
        "family": args.family if method != "fedavg_proxy" else None,
        "models": None if method != "fedavg_proxy" else [args.proxy],
        "proxy": args.proxy,
        "alpha": alpha,
        "seed": seed,
        "rounds": args.rounds,
        "fraction": args.fraction,
        "clients": args.clients,
        "global_test": args.global_test,
        "hyper": hyper,
    }


def fleet_models(spec: dict[str, Any]) -> list[str]:
    """Architecture of each agent: the private pool, or the proxy for ``fedavg_proxy``."""
    from models.families import family_models

    if spec["models"]:
        return [spec["models"][i % len(spec["models"])] for i in range(spec["clients"])]
    return family_models(spec["family"], spec["clients"])


def param_counts(names: list[str], data: str) -> dict[str, int]:
    """Parameters of each architecture at the data's input (1 channel, 10 classes)."""
    from models import create_model

    size = IMAGE_SIZE[data] or 8
    out = {}
    for n in sorted(set(names)):
        m = create_model(n, num_classes=10, in_chans=1, feature_dim=None, input_size=size)
        out[n] = int(sum(p.numel() for p in m.parameters()))
    return out


def sim_run(spec: dict[str, Any], args: argparse.Namespace) -> SimRun:
    """The simulation of ``spec``."""
    return SimRun.from_spec(
        spec,
        models=tuple(fleet_models(spec)),
        feature_dim=None,
        image_size=IMAGE_SIZE[spec["data"]],
        deadline_s=args.deadline,
        max_retries=1,
        run_id="fedtype-repro",
    )


def execute(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Run one simulation and reduce its step records to a small summary."""
    run = sim_run(spec, args)
    steps, wall = simulate_run(run, args.threads, args.work_dir)
    out = {"spec": spec, "wall_s": wall, **summarize(steps)}
    out["params"] = param_counts([*run.models, spec["proxy"]], spec["data"])
    return out


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Final accuracies (all agents), conformal statistics, per-round means, bytes."""
    last = final_step(steps)
    agents = list(last["agents"].values())
    out: dict[str, Any] = {
        "final_phase": last["phase"],
        "final_agents": len(agents),
        **{
            k: mean_of(agents, k)
            for k in ("acc_local", "acc_global", "proxy_acc", "global_proxy_acc")
        },
        "per_client": {
            d: {
                k: a.get(k)
                for k in ("arch", "acc_local", "acc_global", "proxy_acc", "global_proxy_acc")
            }
            for d, a in sorted(last["agents"].items())
        },
    }
    out["per_arch"] = per_arch(agents, ("acc_local", "acc_global"))
    train = train_steps(steps)
    out["steps_failed"] = steps_failed(steps)
    reps = [a for s in train for a in s["agents"].values()]
    out["participations"] = len(reps)
    for k in ("mean_eta", "mean_set_size", "mean_private_set_size", "g_mean"):
        out[k] = mean_of(reps, k)
    out["bkd_skipped_epochs"] = sum(a.get("bkd_skipped_epochs", 0) for a in reps)
    out["sets_not_nested"] = sum(a.get("sets_not_nested", 0) for a in reps)
    # coverage of the calibrated (penalty lambda) sets on the test splits, pooled by n
    n = sum(a.get("coverage_n", 0) for a in reps)
    out["coverage_n"] = n
    for k in ("coverage_proxy", "coverage_private"):
        out[k] = sum(a[k] * a["coverage_n"] for a in reps if k in a) / n if n else None
    # eta and |S| over time: first vs last quarter of the rounds (participants' means)
    q = max(1, len(train) // 4)
    for key in ("mean_eta", "mean_set_size"):
        early = [a for s in train[:q] for a in s["agents"].values()]
        late = [a for s in train[-q:] for a in s["agents"].values()]
        out[f"{key}_first_q"] = mean_of(early, key)
        out[f"{key}_last_q"] = mean_of(late, key)
    # bytes as counted by the coordinator's endpoint (tx = to agents, rx = from them)
    train_tx = sum(step_bytes(s, "tx") for s in train)
    train_rx = sum(step_bytes(s, "rx") for s in train)
    out["bytes_by_kind"] = bytes_by_kind(steps)
    out["bytes_total"] = sum(out["bytes_by_kind"].values())
    # per client per round = per participation of a train step
    out["bytes_down_per_part"] = train_tx / max(len(reps), 1)
    out["bytes_up_per_part"] = train_rx / max(len(reps), 1)
    # steady state: the last train round (round 1 of FedType sends no proxy down)
    if train:
        s = train[-1]
        k_ = max(len(s["agents"]), 1)
        out["bytes_down_last"] = step_bytes(s, "tx") / k_
        out["bytes_up_last"] = step_bytes(s, "rx") / k_
    out["rounds"] = [
        {
            "round": s["round"],
            "n": len(s["agents"]),
            **{k: mean_of(list(s["agents"].values()), k) for k in ROUND_KEYS},
        }
        for s in train
    ]
    return out


# ----- tables ---------------------------------------------------------------------------------
def _setting(r: dict[str, Any]) -> tuple[str, float, int, float]:
    s = r["spec"]
    return (s["data"], s["alpha"], s["rounds"], s["fraction"])


def tables(results: experiment.Results) -> str:
    """Markdown, one block per setting: accuracies, conformal statistics, bytes, pairs."""
    settings: dict[tuple[str, float, int, float], list[dict[str, Any]]] = {}
    for r in results.runs:
        settings.setdefault(_setting(r), []).append(r)
    lines: list[str] = []
    for key in sorted(settings, key=lambda k: (k[0], -k[1], k[2:])):
        data, alpha, rounds, fraction = key
        rs = settings[key]
        groups = by_method(rs)
        order = [m for m in METHODS if m in groups]
        lines += [
            f"### {data}, Dir({alpha:g}), T={rounds}, participation {fraction:g}",
            "",
            "Accuracy in % (mean ± sd over seeds) after the `final` step, unweighted mean over "
            f"all {rs[0]['spec']['clients']} agents. private = each agent's private model on "
            "its own test split (`acc_local`); private@global = the same models on the "
            f"{rs[0]['spec']['global_test']}-image global test set; "
            "proxy = the last local proxy p_i; global proxy = p_g^T, both on the agent's own "
            "test split. `fedavg_proxy`: its final model is p_g^T (global proxy column; p_g: is "
            "the same model on the global test set).",
            "",
            "| method | seeds | private | private@global | proxy | global proxy | wall s |",
            "|---|---|---|---|---|---|---|",
        ]
        for m in order:
            g = groups[m]
            if m == "fedavg_proxy":
                # p_g^T: own test splits (global proxy column), global test set (p_g: ...)
                pg = mean_sd([r["acc_global"] for r in g])
                cells = ["–", f"p_g: {pg}", "–", mean_sd([r["acc_local"] for r in g])]
            else:
                cells = [
                    mean_sd([r["acc_local"] for r in g]),
                    mean_sd([r["acc_global"] for r in g]),
                    mean_sd([r["proxy_acc"] for r in g]),
                    mean_sd([r["global_proxy_acc"] for r in g]),
                ]
            lines.append(
                f"| {m} | {len(g)} | "
                + " | ".join(cells)
                + f" | {statistics.fmean(r['wall_s'] for r in g):.0f} |"
            )
        conf = [m for m in order if METHODS[m].algorithm == "fedtype"]
        if conf:
            lines += [
                "",
                "Conformal statistics (mean over seeds; per participation, all rounds): mean "
                "eta and mean |S| (proxy sets used by BKD), first vs last quarter of the "
                "rounds; |L| private sets; g; coverage of the calibrated proxy / private sets "
                "(penalty lambda) on the test splits, pooled over agents x epochs x rounds "
                "(n = pooled test points per seed); sets not nested (S_g outside S_lambda).",
                "",
                "| method | eta | eta 1st q -> last q | \\|S\\| | \\|S\\| 1st q -> last q | "
                "\\|L\\| | g | cov proxy | cov private | n | BKD-skipped epochs | not nested |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for m in conf:
                g = groups[m]
                lines.append(
                    f"| {m} | {mean_cell([r['mean_eta'] for r in g])} | "
                    f"{mean_cell([r['mean_eta_first_q'] for r in g])} -> "
                    f"{mean_cell([r['mean_eta_last_q'] for r in g])} | "
                    f"{mean_cell([r['mean_set_size'] for r in g])} | "
                    f"{mean_cell([r['mean_set_size_first_q'] for r in g])} -> "
                    f"{mean_cell([r['mean_set_size_last_q'] for r in g])} | "
                    f"{mean_cell([r['mean_private_set_size'] for r in g])} | "
                    f"{mean_cell([r['g_mean'] for r in g], 3)} | "
                    f"{mean_cell([r['coverage_proxy'] for r in g], 3)} | "
                    f"{mean_cell([r['coverage_private'] for r in g], 3)} | "
                    f"{mean_cell([r['coverage_n'] for r in g], 0)} | "
                    f"{mean_cell([r['bkd_skipped_epochs'] for r in g], 1)} | "
                    f"{mean_cell([r['sets_not_nested'] for r in g], 0)} |"
                )
        params = {a: n for r in rs for a, n in r["params"].items()}
        archs = sorted({a for r in rs for a in r["per_arch"]})
        lines += [
            "",
            "Private accuracy per architecture (own test split, %, mean over seeds; parameter "
            "count in brackets):",
            "",
            "| method | " + " | ".join(_arch_head(a, params) for a in archs) + " |",
            "|---|" + "---|" * len(archs),
        ]
        for m in order:
            g = groups[m]
            cells = []
            for a in archs:
                vals = [r["per_arch"][a]["acc_local"] for r in g if a in r["per_arch"]]
                cells.append(f"{100 * statistics.fmean(vals):.1f}" if vals else "–")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        proxy = rs[0]["spec"]["proxy"]
        # FedType's agents register their private model as arch "private" (spec §3.3): the
        # parameter range is that of the known architectures
        priv = [params[a] for a in archs if a != proxy and a in params]
        if not priv and all(a in params for a in archs):
            priv = [params.get(proxy, 0)]  # fedavg_proxy alone: every model is the proxy
        sizes = (
            f"{min(priv):,}-{max(priv):,} parameters = {4 * min(priv):,}-{4 * max(priv):,} B"
            if priv
            else "not disclosed"
        )
        lines += [
            "",
            f"Traffic per client per round (bytes per participation of a train step, mean over "
            f"seeds; down = coordinator to agent, up = agent to coordinator; round 1 of FedType "
            f"sends no proxy down; last = the last round). Proxy `{proxy}`: "
            f"{params.get(proxy, 0):,} parameters = {4 * params.get(proxy, 0):,} B in float32; "
            f"private models: {sizes}.",
            "",
            "| method | down | up | down (last round) | up (last round) | total per run kB |",
            "|---|---|---|---|---|---|",
        ]
        for m in order:
            g = groups[m]
            lines.append(
                f"| {m} | {mean_cell([r['bytes_down_per_part'] for r in g], 0)} | "
                f"{mean_cell([r['bytes_up_per_part'] for r in g], 0)} | "
                f"{mean_cell([r.get('bytes_down_last') for r in g], 0)} | "
                f"{mean_cell([r.get('bytes_up_last') for r in g], 0)} | "
                f"{statistics.fmean(r['bytes_total'] for r in g) / 1e3:,.0f} |"
            )
        lines += [*paired(groups), ""]
    return "\n".join(lines) + "\n"


def _arch_head(arch: str, params: dict[str, int]) -> str:
    """``mlp_xl (4,810)``; an architecture the agents did not disclose has no count."""
    return f"{arch} ({params[arch]:,})" if arch in params else f"{arch} (not disclosed)"


def paired(groups: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Per-seed paired differences (same seed = same partition, init and participants)."""
    keys = ("acc_local", "acc_global", "proxy_acc", "global_proxy_acc")
    rows = paired_rows(groups, PAIRS, keys, mean_sd, wins="acc_local")
    # FedType's own ordering claim: private > proxy > global, per seed
    order_rows = []
    for m, g in groups.items():
        if METHODS[m].algorithm != "fedtype":
            continue
        pp = [r["acc_local"] - r["proxy_acc"] for r in g]
        pg = [r["proxy_acc"] - r["global_proxy_acc"] for r in g]
        both = sum(1 for x, y in zip(pp, pg, strict=False) if x > 0 and y > 0)
        order_rows.append(f"| {m} | {len(g)} | {mean_sd(pp)} | {mean_sd(pg)} | {both}/{len(g)} |")
    out: list[str] = []
    if rows:
        out += [
            "",
            "Paired differences (percentage points, mean ± sd over seeds):",
            "",
            "| comparison | seeds | private | private@global | proxy | global proxy "
            "| seeds with private > 0 |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
    if order_rows:
        out += [
            "",
            "Claim (i) per seed: private − proxy and proxy − global proxy (pp, own test splits):",
            "",
            "| method | seeds | private − proxy | proxy − global | seeds with both > 0 |",
            "|---|---|---|---|---|",
            *order_rows,
        ]
    return out


def _describe(r: dict[str, Any]) -> str:
    def f(v: float | None) -> str:
        return "–" if v is None or math.isnan(v) else f"{v:.3f}"

    return (
        f"private={f(r['acc_local'])} private@g={f(r['acc_global'])} "
        f"proxy={f(r['proxy_acc'])} global={f(r['global_proxy_acc'])} eta={f(r['mean_eta'])} "
        f"|S|={f(r['mean_set_size'])} cov={f(r['coverage_proxy'])} "
        f"up/part={r['bytes_up_per_part']:.0f}B wall={r['wall_s']:.0f}s"
    )


EXPERIMENT = experiment.Experiment(
    description=__doc__ or "",
    preset=PRESET,
    spec=run_spec,
    execute=execute,
    describe=_describe,
    tables=tables,
    add_args=add_args,
    dirty=True,
    sim_run=sim_run,
)


if __name__ == "__main__":
    experiment.main(EXPERIMENT)
