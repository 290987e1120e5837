"""Felo / Velo at CPU scale: the reproduction of ``shared/specs/felo_velo.md`` §9.

Every run goes through :func:`coordinator.sim.simulate.simulate` (the in-memory transport, the same
code paths as a real fleet), so accuracies are what the agents report and bytes are what the
coordinator's endpoint counted.

Setting (spec §9, defaults of this script): ``digits`` (8x8), K = 10 agents, family
``tiny_felo`` (five architectures, two clients each, d_f = 32), Dir(alpha) label skew, a fixed
global test set of 360 images, T = 60 rounds, participation 0.5 (the seeded choice of the
coordinator, identical for every method of one seed), warm-up 3 rounds (``warmup_fraction``
0.05), Adam 1e-3, batch 16, one local epoch, kd_weight 0.5, Velo CVAE z 16 / embed 16 /
hidden 64, 10 epochs per training event, batch 50. ``--data mnist5k`` runs the same on the
5000-image MNIST subset at 28x28.

Methods (spec §9 revised): {CE, FedHe (logits only), Felo features only, Felo, Velo} x
{``same_arch_avg`` on (``_avg``), off (``_noavg``)}. Every Felo-family variant runs the
registered ``felo`` algorithm with overrides (Velo runs ``velo``, which only adds the CVAE), so
the rows differ in configuration only. ``ce_avg`` is group FedAvg; ``local`` is the plain
local-only baseline (``ce_noavg`` is its Felo-path twin). Homogeneous comparison (Table 2):
``--family homo_mlp --methods fedavg felo_avg velo_avg``. Interval ablation (Table 4):
``velo_avg_int{2,5,10}`` (``velo_avg`` is interval 1).

Usage::

    python benchmarks/felo_repro.py --alphas 0.5 --seeds 0 1 2 \\
        --out benchmarks/results/felo_digits.json --md benchmarks/results/felo_digits.md
    python benchmarks/felo_repro.py --out benchmarks/results/felo_digits.json --table-only

Settings, arms and compared pairs: ``benchmarks/presets/felo.toml`` (``--preset mnist5k``: the
MNIST-5k grid; ``--preset encoding``: the weight encodings). Results are appended to ``--out``
after every run; a rerun skips runs already there with the
same settings, so an interrupted grid resumes. A run that raises is recorded under
``failures`` (with its traceback) and retried by the next invocation.
"""

from __future__ import annotations

import argparse
import logging
import statistics
from typing import Any

import experiment
from experiment.summary import (
    by_method,
    bytes_by_kind,
    bytes_by_phase,
    late_mean,
    paired_rows,
    per_arch,
    steps_failed,
)
from harness import IMAGE_SIZE, SimRun, final_step, mean_of, mean_sd, simulate_run, train_steps

# the in-process transport's agents and the coordinator log per step; the grid prints a line
# per run instead
logging.basicConfig(level=logging.ERROR)

PRESET = experiment.load_preset("felo")
METHODS = PRESET.arms
PAIRS = PRESET.pairs()  # headline paired comparisons (a - b), percentage points


def add_args(ap: argparse.ArgumentParser) -> None:
    """The script's own options (defaults: benchmarks/presets/felo.toml)."""
    ap.add_argument("--data", choices=sorted(IMAGE_SIZE))
    ap.add_argument("--clients", type=int, help="K")
    ap.add_argument("--family", help="models.families name")
    ap.add_argument("--feature-dim", type=int)
    ap.add_argument("--rounds", type=int, help="T (paper: 100)")
    ap.add_argument("--fraction", type=float, help="participation (paper: 0.2)")
    ap.add_argument("--epochs", type=int, help="local epochs per participation")
    ap.add_argument("--lr", type=float, help="Adam learning rate")
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--kd-weight", type=float, help="alpha of Eq. (1)")
    ap.add_argument("--warmup-fraction", type=float, help="0.05*60 = 3 rounds")
    ap.add_argument(
        "--window",
        default=None,
        choices=["history_fifo", "latest_per_client", "current_round"],
        help="knowledge_window (default: the algorithm's, history_fifo)",
    )
    ap.add_argument("--cvae-z", type=int)
    ap.add_argument("--cvae-embed", type=int)
    ap.add_argument("--cvae-hidden", type=int)
    ap.add_argument("--cvae-epochs", type=int)
    ap.add_argument("--cvae-batch", type=int)
    ap.add_argument("--global-test", type=int)
    ap.add_argument(
        "--cvae-singleton-workaround",
        action="store_true",
        help="harness-side workaround for Velo runs that crash in the CVAE fit when a shuffled "
        "epoch ends in a batch of one (BatchNorm1d in train mode): that batch runs with the "
        "encoder's BatchNorm in eval mode (running statistics); each run records how often "
        "it fired (cvae_singleton_batches). Off by default.",
    )


def run_spec(args: argparse.Namespace, method: str, alpha: float, seed: int) -> dict[str, Any]:
    """Everything that determines one run (also its identity in the results file)."""
    arm = METHODS[method]
    algorithm = arm.algorithm
    hyper: dict[str, Any] = {
        "local_epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "optimizer": "adam",
    }
    if algorithm in ("felo", "velo", "fedhe"):
        hyper.update(kd_weight=args.kd_weight, warmup_fraction=args.warmup_fraction)
        if args.window is not None:
            hyper["knowledge_window"] = args.window
    if algorithm == "velo":
        hyper.update(
            cvae_z_dim=args.cvae_z,
            cvae_embed_dim=args.cvae_embed,
            cvae_hidden=args.cvae_hidden,
            cvae_epochs=args.cvae_epochs,
            cvae_batch_size=args.cvae_batch,
        )
    hyper.update(arm.hyper)
    return {
        "method": method,
        "algorithm": algorithm,
        "data": args.data,
        "family": args.family,
        "alpha": alpha,
        "seed": seed,
        "rounds": args.rounds,
        "fraction": args.fraction,
        "clients": args.clients,
        "feature_dim": args.feature_dim,
        "global_test": args.global_test,
        "hyper": hyper,
    }


_SINGLETONS = [0]


def _patch_cvae_singletons() -> None:
    """Velo's CVAE encoder has a BatchNorm1d, and the shared fit loop keeps a last batch of one
    sample (``n % batch_size == 1``), which BatchNorm refuses in train mode. Run such a batch
    with the BatchNorm layers in eval mode (running statistics) and count it."""
    from torch import nn

    import coordinator.strategies.felo.cvae as vc

    if getattr(vc.cvae_loss_fn, "_singleton_patch", False):
        return
    original = vc.cvae_loss_fn

    def patched(name: str) -> Any:
        loss_fn = original(name)

        def wrapped(module: Any, batch: Any, generator: Any) -> Any:
            if int(batch[0].shape[0]) > 1:
                return loss_fn(module, batch, generator)
            _SINGLETONS[0] += 1
            bns = [
                m
                for m in module.modules()
                if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
            ]
            for m in bns:
                m.eval()
            try:
                return loss_fn(module, batch, generator)
            finally:
                for m in bns:
                    m.train()

        return wrapped

    patched._singleton_patch = True  # type: ignore[attr-defined]
    vc.cvae_loss_fn = patched  # type: ignore[assignment]  # the workaround replaces it


def execute(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Run one simulation and reduce its step records to a small summary."""
    if args.cvae_singleton_workaround and spec["algorithm"] == "velo":
        _patch_cvae_singletons()
        _SINGLETONS[0] = 0
        r = _execute(spec, args)
        r["workaround"] = "cvae_singleton_bn_eval"
        r["cvae_singleton_batches"] = _SINGLETONS[0]
        return r
    return _execute(spec, args)


def sim_run(spec: dict[str, Any], args: argparse.Namespace) -> SimRun:
    """The simulation of ``spec``."""
    from models.families import family_models

    return SimRun.from_spec(
        spec,
        models=tuple(family_models(spec["family"], spec["clients"])),
        image_size=IMAGE_SIZE[spec["data"]],
        deadline_s=args.deadline,
        max_retries=1,
        run_id="felo-repro",
    )


def _execute(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    steps, wall = simulate_run(sim_run(spec, args), args.threads, args.work_dir)
    return {"spec": spec, "wall_s": wall, **summarize(steps, spec["rounds"])}


def summarize(steps: list[dict[str, Any]], T: int) -> dict[str, Any]:
    """Final (all agents) and second-half (round means) accuracies, per-group, bytes."""
    last = final_step(steps)
    agents = list(last["agents"].values())
    out: dict[str, Any] = {
        "final_phase": last["phase"],
        "final_agents": len(agents),
        "acc_global": mean_of(agents, "acc_global"),
        "acc_local": mean_of(agents, "acc_local"),
        "per_client": {
            d: {
                "arch": a.get("arch"),
                "acc_global": a.get("acc_global"),
                "acc_local": a.get("acc_local"),
            }
            for d, a in sorted(last["agents"].items())
        },
    }
    out["per_arch"] = per_arch(agents, ("acc_global", "acc_local"))
    train = train_steps(steps)
    out["steps_failed"] = steps_failed(steps)
    for key in ("acc_global", "acc_local"):
        out[f"half_{key}"] = late_mean(train, key, T / 2)
    # bytes as counted by the coordinator's endpoint (tx = to agents, rx = from them)
    out["bytes_by_kind"] = bytes_by_kind(steps)
    out["bytes_by_phase"] = bytes_by_phase(steps)
    out["bytes_total"] = sum(out["bytes_by_kind"].values())
    out["participations"] = sum(len(s["agents"]) for s in train)
    out["rounds"] = [
        {
            "round": s["round"],
            "acc_global": s.get("mean_acc_global"),
            "acc_local": s.get("mean_acc_local"),
            "n": len(s["agents"]),
            **{k: v for k, v in s.get("aggregate", {}).items() if isinstance(v, (int, float))},
        }
        for s in train
    ]
    return out


# ----- tables ---------------------------------------------------------------------------------
def _setting(r: dict[str, Any]) -> tuple[str, str, float, int, float]:
    s = r["spec"]
    return (s["data"], s["family"], s["alpha"], s["rounds"], s["fraction"])


def _setting_name(key: tuple[str, str, float, int, float]) -> str:
    data, family, alpha, rounds, fraction = key
    return f"{data}, {family}, Dir({alpha:g}), T={rounds}, participation {fraction:g}"


def _kb(n: float) -> str:
    return f"{n / 1e3:,.0f}"


def tables(results: experiment.Results) -> str:
    """Markdown, one block per setting: accuracies, per-group, bytes, paired differences."""
    settings: dict[tuple[str, str, float, int, float], list[dict[str, Any]]] = {}
    for r in results.runs:
        settings.setdefault(_setting(r), []).append(r)
    lines: list[str] = []
    # heterogeneous family first, larger alpha (milder skew) first
    for key in sorted(settings, key=lambda k: (k[0], k[1] != "tiny_felo", k[1], -k[2], k[3:])):
        rs = settings[key]
        groups = by_method(rs)
        order = [m for m in METHODS if m in groups]
        lines += [
            f"### {_setting_name(key)}",
            "",
            "Accuracy in % (mean ± sd over seeds). final = the `final` step, all agents; "
            "2nd half = mean over rounds T/2..T of the round mean (that round's participants).",
            "",
            "| method | algorithm | seeds | final global | final local | 2nd-half global | "
            "2nd-half local | wall s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for m in order:
            g = groups[m]
            lines.append(
                f"| {m} | {g[0]['spec']['algorithm']} | {len(g)} | "
                f"{mean_sd([r['acc_global'] for r in g])} | "
                f"{mean_sd([r['acc_local'] for r in g])} | "
                f"{mean_sd([r['half_acc_global'] for r in g])} | "
                f"{mean_sd([r['half_acc_local'] for r in g])} | "
                f"{statistics.fmean(r['wall_s'] for r in g):.0f} |"
            )
        archs = sorted({a for r in rs for a in r["per_arch"]})
        lines += [
            "",
            "Final global-test accuracy per architecture group (%, mean over seeds):",
            "",
            "| method | " + " | ".join(archs) + " |",
            "|---|" + "---|" * len(archs),
        ]
        for m in order:
            g = groups[m]
            cells = []
            for a in archs:
                vals = [r["per_arch"][a]["acc_global"] for r in g if a in r["per_arch"]]
                cells.append(f"{100 * statistics.fmean(vals):.1f}" if vals else "–")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        kinds = sorted({k for r in rs for k in r["bytes_by_kind"]})
        lines += [
            "",
            "Traffic per run (kB, mean over seeds; tx = coordinator to agents, rx = agents to "
            "coordinator; all steps incl. final):",
            "",
            "| method | " + " | ".join(kinds) + " | total | per participation |",
            "|---|" + "---|" * (len(kinds) + 2),
        ]
        for m in order:
            g = groups[m]
            cells = [_kb(statistics.fmean(r["bytes_by_kind"].get(k, 0) for r in g)) for k in kinds]
            tot = statistics.fmean(r["bytes_total"] for r in g)
            per = statistics.fmean(r["bytes_total"] / max(r["participations"], 1) for r in g)
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {_kb(tot)} | {per / 1e3:.1f} |")
        lines += [*paired(groups), ""]
    return "\n".join(lines) + "\n"


def paired(groups: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Per-seed paired differences (same seed = same partition, init and participants)."""
    extra = [(m, "local") for m in groups if m != "local" and (m, "local") not in PAIRS]
    keys = ("acc_global", "acc_local", "half_acc_global", "half_acc_local")
    rows = paired_rows(groups, [*PAIRS, *extra], keys, mean_sd, wins="acc_global")
    if not rows:
        return []
    return [
        "",
        "Paired differences (percentage points, mean ± sd over seeds):",
        "",
        "| comparison | seeds | final global | final local | 2nd-half global | 2nd-half local "
        "| seeds with final global > 0 |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]


def _describe(r: dict[str, Any]) -> str:
    return (
        f"final g/l={r['acc_global']:.3f}/{r['acc_local']:.3f} "
        f"half g/l={r['half_acc_global']:.3f}/{r['half_acc_local']:.3f} "
        f"kB={r['bytes_total'] / 1e3:.0f} wall={r['wall_s']:.0f}s"
        + (
            f" singleton-batches={r['cvae_singleton_batches']}"
            if "cvae_singleton_batches" in r
            else ""
        )
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
