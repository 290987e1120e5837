"""FedVTC at CPU scale: an honest reproduction on real MNIST digits.

Every run goes through :func:`coordinator.sim.simulate.simulate` (the in-memory transport, the same
code paths as a real fleet), so accuracies are what the agents report and bytes are what the
coordinator's endpoint counted. Setting: ``mnist5k`` at 28x28, the paper's MNIST VTC generator
(p = 980 -> 20x7x7), a heterogeneous fleet (family ``tiny``: two MLPs, three small CNNs, each
with a Linear projection to p), K clients with full participation, Dir(alpha) label skew, a
held-out global test set on which every agent is evaluated.

Methods (``--methods``):

* ``local``, ``fedproto``: T + FT rounds, all with full participation (spec §8-D17: baselines get
  the fine-tuning rounds as extra federated rounds); accuracy at round T is kept too.
* ``fedvtc_le``: FedVTC with L_e only (``use_dm = false``, the Table 4 ablation).
* ``fedvtc``: FedVTC with L_tc, paper settings otherwise, with ``diagnostics``: the noise
  control (same pre-fine-tuning models fine-tuned on uniform noise with the same labels) and
  the synthetic-only probe (a fresh MLP trained on the synthetic set, tested on real images).
* ``fedvtc_f16``: ``fedvtc`` with prototypes and SDs sent as float16.
* ``fedvtc_noclip``: ``fedvtc`` without gradient clipping (the paper has none).
* ``fedvtc_combo_every``: ``fedvtc_combo`` with the generator averaged every round (Table 3 ②).
* ``fedvtc_combo_f16``: ``fedvtc_combo`` with float16 transport (diagnostics off; they run on
  copies and do not change the fine-tuned model).
* ``fedvtc_recal``: ``fedvtc`` + re-estimated generator BatchNorm statistics after averaging.
* ``fedvtc_fix``: ``fedvtc`` + the deviations of ``--fix`` (default ``model_tc_weight=0.01``:
  L_tc weighted 0.01 in the model's step A only; see docs/algorithms/fedvtc.md).
* ``fedvtc_combo``: ``fedvtc`` + three deviations together (chosen on a one-seed scan, see
  docs/algorithms/fedvtc.md "Combined deviations"): ``model_tc_weight=0.1``, BN re-estimation of the
  averaged generator, and sigma held at 0.1 (``sd_init=0.1``, ``sd_max=0.1``).

Usage::

    python benchmarks/fedvtc_repro.py --out benchmarks/results/fedvtc_repro.json \\
        --md benchmarks/results/fedvtc_repro.md
    python benchmarks/fedvtc_repro.py --out benchmarks/results/fedvtc_repro.json --table-only

Settings, arms and the pairs of the tables: ``benchmarks/presets/fedvtc.toml`` (``--preset
seeded``, ``--preset fixed``: the grids of docs/algorithms/fedvtc.md). Results are appended to
``--out``
after every run; a rerun skips runs already there with the same settings, so an interrupted
grid resumes. A run that raises is recorded under
``failures`` (with its traceback) and retried by the next invocation.
"""

from __future__ import annotations

import argparse
import logging
import statistics
from typing import Any

import experiment
from experiment.summary import bytes_by_phase
from harness import SimRun, by_seed, mean_of, mean_sd, simulate_run

# the in-process transport's agents and the coordinator log per step; the grid prints a line
# per run instead
logging.basicConfig(level=logging.ERROR)

PRESET = experiment.load_preset("fedvtc")
METHODS = PRESET.arms
# float16 variants and the float32 method each is paired with (same seeds)
F16_PAIRS = PRESET.pairs("f16_pairs")
# methods with the noise control and the probe, in the paired and diagnostics tables
DIAG_METHODS = tuple(PRESET.other["report"]["diag_methods"])
# per-round diagnostics kept in the JSON (means over the agents of that round)
ROUND_KEYS = (
    "diag_ce",
    "diag_tc",
    "diag_rc",
    "diag_kl",
    "diag_dm",
    "diag_sigma_norm",
    "diag_proto_norm",
    "diag_proto_sep",
    "diag_global_proto_norm",
    "diag_gen_min",
    "diag_gen_max",
    "diag_gen_std",
    "diag_gen_class_contrast",
)
FINAL_KEYS = (
    "acc_global_before_ft",
    "acc_global_noise_control",
    "probe_acc_global",
    "probe_acc_global_own_gen",
    "gen_min",
    "gen_max",
    "gen_std",
    "gen_class_contrast",
    "gen_std_own_gen",
    "gen_class_contrast_own_gen",
    "finetune_loss",
)


def add_args(ap: argparse.ArgumentParser) -> None:
    """The script's own options (defaults: benchmarks/presets/fedvtc.toml)."""
    ap.add_argument(
        "--f16-seeds",
        nargs="+",
        type=int,
        default=None,
        help="seeds for fedvtc_f16 (default: all of --seeds)",
    )
    ap.add_argument("--clients", type=int, help="K (all participate every round)")
    ap.add_argument("--family", help="models.families name")
    ap.add_argument("--rounds", type=int, help="T (paper: 100)")
    ap.add_argument("--epochs", type=int, help="E (paper: 5)")
    ap.add_argument("--lr", type=float, help="eta for everything (paper: 1e-4)")
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--grad-clip", type=float)
    ap.add_argument(
        "--grad-clip-mode",
        choices=["split", "joint"],
        help="FedVTC: clip head/extractor and psi/sigma apart (split) or together (joint, "
        "L_tc's gradient then shrinks the head's step)",
    )
    ap.add_argument(
        "--generator-mode-step-a",
        choices=["train", "eval"],
        help="FedVTC: psi's mode in step A (train: BatchNorm on batch statistics, as in step B)",
    )
    ap.add_argument("--synthetic-per-class", type=int, help="S (paper: 500)")
    ap.add_argument("--finetune-epochs", type=int, help="FT rounds (paper: 5)")
    ap.add_argument("--global-test", type=int)
    ap.add_argument("--fix", nargs="*", help="hyper KEY=VALUE pairs that fedvtc_fix adds")


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text, text)


def run_spec(
    args: argparse.Namespace, method: str, alpha: float, seed: int
) -> dict[str, Any] | None:
    """Everything that determines one run (also its identity in the results file); None for a
    float16 method at a seed ``--f16-seeds`` leaves out."""
    if method.endswith("_f16") and args.f16_seeds is not None and seed not in args.f16_seeds:
        return None
    algorithm = METHODS[method].algorithm
    hyper: dict[str, Any] = {
        "local_epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "momentum": 0.0,
        "grad_clip": args.grad_clip,
        **METHODS[method].hyper,
    }
    if algorithm == "fedvtc":
        hyper.update(
            synthetic_per_class=args.synthetic_per_class,
            finetune_epochs=args.finetune_epochs,
            grad_clip_mode=args.grad_clip_mode,
            generator_mode_step_a=args.generator_mode_step_a,
        )
    if method == "fedvtc_fix":
        hyper.update({k: _value(v) for k, v in (kv.split("=", 1) for kv in args.fix)})
    # baselines: the fine-tuning rounds become extra federated rounds (spec §8-D17)
    rounds = args.rounds if algorithm == "fedvtc" else args.rounds + args.finetune_epochs
    return {
        "method": method,
        "algorithm": algorithm,
        "alpha": alpha,
        "seed": seed,
        "rounds": rounds,
        "T": args.rounds,
        "clients": args.clients,
        "family": args.family,
        "global_test": args.global_test,
        "hyper": hyper,
    }


def sim_run(spec: dict[str, Any], args: argparse.Namespace) -> SimRun:
    """The simulation of ``spec``."""
    from models.families import family_models

    return SimRun.from_spec(
        spec,
        models=tuple(family_models(spec["family"], spec["clients"])),
        data="mnist5k",
        feature_dim=980,
        image_size=28,
        deadline_s=7200.0,
        run_id="repro",
    )


def execute(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Run one simulation and reduce its step records to a small summary."""
    steps, wall = simulate_run(sim_run(spec, args), args.threads, args.work_dir)
    return {"spec": spec, "wall_s": wall, **summarize(steps, spec["T"])}


def summarize(steps: list[dict[str, Any]], T: int) -> dict[str, Any]:
    """Client-mean accuracies, controls, per-phase bytes and per-round diagnostics."""
    last = steps[-1]
    agents = list(last["agents"].values())
    out: dict[str, Any] = {
        "acc_global": mean_of(agents, "acc_global"),
        "per_client_acc_global": [a.get("acc_global") for a in agents],
    }
    at_t = [s for s in steps if s["phase"] == "train" and s["round"] == T]
    out["acc_global_round_T"] = (
        mean_of(list(at_t[0]["agents"].values()), "acc_global") if at_t else None
    )
    out.update({k: mean_of(agents, k) for k in FINAL_KEYS if mean_of(agents, k) is not None})
    # bytes as counted by the coordinator's endpoint per step (tx = to agents, rx = from them)
    phases = bytes_by_phase(
        steps,
        lambda s: "extra_rounds" if s["phase"] == "train" and s["round"] > T else s["phase"],
    )
    out["bytes_by_phase"] = phases
    out["bytes_total"] = sum(sum(b.values()) for b in phases.values())
    out["rounds"] = [
        {
            "round": s["round"],
            "acc_global": s.get("mean_acc_global"),
            "sigma_mean": s["aggregate"].get("sigma_mean"),
            **{
                k: mean_of(list(s["agents"].values()), k)
                for k in ROUND_KEYS
                if mean_of(list(s["agents"].values()), k) is not None
            },
        }
        for s in steps
        if s["phase"] == "train"
    ]
    return out


# ----- tables ---------------------------------------------------------------------------------
def tables(results: experiment.Results) -> str:
    """Markdown: accuracy/control table per (method, alpha) and a traffic table per method."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in results.runs:
        groups.setdefault((r["spec"]["method"], r["spec"]["alpha"]), []).append(r)
    order = [m for m in METHODS if any(k[0] == m for k in groups)]
    lines = [
        "| method | Dir α | seeds | acc at T (before FT) | final acc (after FT) | "
        "noise control | probe (synthetic only) | probe, own ψ | MB total |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in order:
        for alpha in sorted({k[1] for k in groups if k[0] == m}):
            rs = groups[(m, alpha)]
            before = [r.get("acc_global_before_ft", r.get("acc_global_round_T")) for r in rs]
            lines.append(
                f"| {m} | {alpha:g} | {len(rs)} | {mean_sd(before)}"
                f" | {mean_sd([r['acc_global'] for r in rs])}"
                f" | {mean_sd([r.get('acc_global_noise_control') for r in rs])}"
                f" | {mean_sd([r.get('probe_acc_global') for r in rs])}"
                f" | {mean_sd([r.get('probe_acc_global_own_gen') for r in rs])}"
                f" | {statistics.fmean(r['bytes_total'] for r in rs) / 1e6:.2f} |"
            )
    lines += [
        "",
        "Traffic per run (MB, mean over runs; tx = coordinator to agents, "
        "rx = agents to coordinator):",
        "",
        "| method | Dir α | train rounds tx / rx | extra rounds tx / rx | "
        "generator upload rx | final tx | total |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in order:
        for alpha in sorted({k[1] for k in groups if k[0] == m}):
            rs = groups[(m, alpha)]

            def mb(phase: str, direction: str, rs: list[dict[str, Any]] = rs) -> str:
                tot = [
                    sum(
                        v
                        for k, v in r["bytes_by_phase"].get(phase, {}).items()
                        if k.startswith(direction)
                    )
                    for r in rs
                ]
                return f"{statistics.fmean(tot) / 1e6:.3f}"

            lines.append(
                f"| {m} | {alpha:g} | {mb('train', 'tx')} / {mb('train', 'rx')} | "
                f"{mb('extra_rounds', 'tx')} / {mb('extra_rounds', 'rx')} | "
                f"{mb('upload_generator', 'rx')} | {mb('final', 'tx')} | "
                f"{statistics.fmean(r['bytes_total'] for r in rs) / 1e6:.3f} |"
            )
    return "\n".join(lines + paired_tables(groups)) + "\n"


def _diff(a: dict[str, Any], b: dict[str, Any] | None, key_a: str, key_b: str) -> float | None:
    va, vb = a.get(key_a), None if b is None else b.get(key_b)
    return None if va is None or vb is None else float(va) - float(vb)


def paired_tables(groups: dict[tuple[str, float], list[dict[str, Any]]]) -> list[str]:
    """Per-seed paired effects: fine-tuning gain, FT vs the noise control, probe vs chance,
    FedVTC vs the baselines, float16 transport, and the last round's diagnostics."""
    alphas = sorted({k[1] for k in groups})
    lines = [
        "",
        "Paired effects (percentage points, mean ± sd over seeds; same seed = same "
        "partition and model init):",
        "",
        "| method | Dir α | FT gain (after − before) | after − noise control | "
        "probe − chance (10%) | after − local | after − FedProto |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in DIAG_METHODS:
        for alpha in alphas:
            rs = groups.get((m, alpha), [])
            if not rs:
                continue
            local = by_seed(groups.get(("local", alpha), []))
            proto = by_seed(groups.get(("fedproto", alpha), []))

            def seed(r: dict[str, Any]) -> int:
                return int(r["spec"]["seed"])

            cols = [
                [_diff(r, r, "acc_global", "acc_global_before_ft") for r in rs],
                [_diff(r, r, "acc_global", "acc_global_noise_control") for r in rs],
                [
                    None if r.get("probe_acc_global") is None else r["probe_acc_global"] - 0.1
                    for r in rs
                ],
                [_diff(r, local.get(seed(r)), "acc_global", "acc_global") for r in rs],
                [_diff(r, proto.get(seed(r)), "acc_global", "acc_global") for r in rs],
            ]
            lines.append(
                f"| {m} | {alpha:g} | "
                + " | ".join(mean_sd([v for v in c if v is not None]) for c in cols)
                + " |"
            )
    lines += [
        "",
        "float16 transport of prototypes and SDs (each f16 method paired with its float32 "
        "method, same seeds; MB without the time-throttled progress messages):",
        "",
        "| method | Dir α | seeds | train-round MB raw | train-round MB f16 | saving | "
        "total MB raw → f16 | acc f16 − raw (pp) |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def payload_mb(r: dict[str, Any], phase: str | None = None) -> float:
        phases = [phase] if phase else list(r["bytes_by_phase"])
        return float(
            sum(
                n
                for ph in phases
                for kind, n in r["bytes_by_phase"].get(ph, {}).items()
                if not kind.endswith(".progress")
            )
            / 1e6
        )

    for base, variant in F16_PAIRS:
        for alpha in alphas:
            f16 = by_seed(groups.get((variant, alpha), []))
            raw = {k: v for k, v in by_seed(groups.get((base, alpha), [])).items() if k in f16}
            if not raw:
                continue
            a = statistics.fmean(payload_mb(r, "train") for r in raw.values())
            b = statistics.fmean(payload_mb(f16[k], "train") for k in raw)
            ta = statistics.fmean(payload_mb(r) for r in raw.values())
            tb = statistics.fmean(payload_mb(f16[k]) for k in raw)
            acc = [f16[k]["acc_global"] - raw[k]["acc_global"] for k in raw]
            lines.append(
                f"| {variant} | {alpha:g} | {len(raw)} | {a:.3f} | {b:.3f} | "
                f"{100 * (1 - b / a):.1f}% | {ta:.2f} → {tb:.2f} | {mean_sd(acc)} |"
            )
    lines += [
        "",
        "Last training round's diagnostics (means over agents, then over seeds; "
        "‖σ‖ vs the prototypes' norm and mean pairwise separation; loss terms as reduced "
        "in the loss; generator output std and class contrast of the averaged ψ vs the "
        "client's own):",
        "",
        "| method | Dir α | σ mean | ‖σ‖ | proto norm | proto sep | CE | L_rc | KL | L_dm | "
        "gen std avg / own | class contrast avg / own | probe own ψ |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in DIAG_METHODS:
        for alpha in alphas:
            rs = groups.get((m, alpha), [])
            if not rs:
                continue

            def last(key: str, rs: list[dict[str, Any]] = rs) -> str:
                vals = [r["rounds"][-1].get(key) for r in rs if r["rounds"]]
                vals = [v for v in vals if v is not None]
                return f"{statistics.fmean(vals):.3g}" if vals else "–"

            def fin(key: str, rs: list[dict[str, Any]] = rs) -> str:
                vals = [r[key] for r in rs if r.get(key) is not None]
                return f"{statistics.fmean(vals):.3g}" if vals else "–"

            lines.append(
                f"| {m} | {alpha:g} | {last('sigma_mean')} | {last('diag_sigma_norm')} | "
                f"{last('diag_proto_norm')} | {last('diag_proto_sep')} | {last('diag_ce')} | "
                f"{last('diag_rc')} | {last('diag_kl')} | {last('diag_dm')} | "
                f"{fin('gen_std')} / {fin('gen_std_own_gen')} | {fin('gen_class_contrast')} / "
                f"{fin('gen_class_contrast_own_gen')} | "
                f"{mean_sd([r.get('probe_acc_global_own_gen') for r in rs])} |"
            )
    return lines


def _describe(r: dict[str, Any]) -> str:
    return (
        f"acc={r['acc_global']:.3f} before={r.get('acc_global_before_ft')} "
        f"noise={r.get('acc_global_noise_control')} probe={r.get('probe_acc_global')} "
        f"MB={r['bytes_total'] / 1e6:.2f} wall={r['wall_s']:.0f}s"
    )


EXPERIMENT = experiment.Experiment(
    description=__doc__ or "",
    preset=PRESET,
    spec=run_spec,
    execute=execute,
    describe=_describe,
    tables=tables,
    add_args=add_args,
    deadline=None,
    code=False,
    sim_run=sim_run,
)


if __name__ == "__main__":
    experiment.main(EXPERIMENT)
