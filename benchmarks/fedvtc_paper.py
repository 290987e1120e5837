"""FedVTC in the paper's own MNIST regime: the run that decides whether its Table 7 holds.

One command, the paper's settings (FedVTC, Niu et al., §5 and Table 6): ResNet-18/34/50/101/152
(family ``fedvtc``, client k gets kind k mod 5) with a Linear projection to p = 980 and the
20x7x7 -> 1x28x28 VTC generator; MNIST (torchvision's files under ``--data-root``, or the
bundled 5000-image ``mnist5k`` without one); K = 100 clients at Dir(alpha), 10 % sampled per
round; T = 100, E = 5, eta = 1e-4 (plain SGD), S = 500, 5 fine-tuning epochs; no gradient
clipping; psi in train mode in step A. Diagnostics are on: every client reports its
accuracy on the held-out global test set before and after fine-tuning, the noise control
(the same pre-fine-tuning model fine-tuned on uniform noise with the same labels) and the
synthetic-only probe.

Agents run as threads of one process over the in-memory transport (``coordinator.sim.simulate``)
on ``--device`` (``auto``: CUDA when torch sees a GPU) with mixed precision on CUDA. The run
directory is durable: an interrupted run resumes where it stopped when the same command is run
again (the coordinator's store and each agent's checkpoint); a finished run's summary is kept
in ``--out`` and printed again.

Usage::

    python benchmarks/fedvtc_paper.py --data-root ~/data --run-dir runs/fedvtc-paper
    # CPU smoke: the same pipeline, 2 rounds, sizes a CPU can run (ResNet-152 takes ~40 s per
    # batch of 16 on one busy core): a 4-layer ResNet, 10 clients, 200 images each
    python benchmarks/fedvtc_paper.py --rounds 2 --models resnet4 --clients 10 --fraction 0.2 \
        --epochs 1 --synthetic-per-class 5 --finetune-epochs 1 --global-test 3000 \
        --threads 1 --run-dir /tmp/fedvtc-smoke
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

logging.basicConfig(level=logging.ERROR)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line; every default is the paper's MNIST setting."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-root", default=None, help="torchvision root with MNIST/raw")
    ap.add_argument("--family", default="fedvtc", help="models.families name")
    ap.add_argument("--models", default=None, help="comma list instead of --family (smoke)")
    ap.add_argument("--clients", type=int, default=100, help="K")
    ap.add_argument("--fraction", type=float, default=0.1, help="share sampled per round")
    ap.add_argument("--alpha", type=float, default=0.1, help="Dir(alpha) label skew")
    ap.add_argument("--rounds", type=int, default=100, help="T")
    ap.add_argument("--epochs", type=int, default=5, help="E")
    ap.add_argument("--lr", type=float, default=1e-4, help="eta (f, psi and sigma)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--synthetic-per-class", type=int, default=500, help="S")
    ap.add_argument("--finetune-epochs", type=int, default=5)
    ap.add_argument("--global-test", type=int, default=None, help="default: 10000, 1000 (5k)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's)")
    ap.add_argument("--run-dir", type=Path, default=Path("runs/fedvtc-paper"))
    ap.add_argument("--out", type=Path, default=None, help="default: RUN_DIR/summary.json")
    return ap.parse_args(argv)


def hyper(args: argparse.Namespace) -> dict[str, Any]:
    """FedVTC's settings: the paper's (no gradient clipping, psi in train mode in step A)."""
    return {
        "local_epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "momentum": 0.0,
        "grad_clip": 0.0,  # the paper has no clipping (so grad_clip_mode does not matter)
        "generator_mode_step_a": "train",
        "synthetic_per_class": args.synthetic_per_class,
        "finetune_epochs": args.finetune_epochs,
        "mixed_precision": True,  # autocast + GradScaler on CUDA; ignored on CPU
        "diagnostics": True,  # noise control and probe in the final phase
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start or resume the run in ``--run-dir``; its summary (as ``fedvtc_repro``'s)."""
    from fedvtc_repro import summarize

    from coordinator.config import read_layers
    from coordinator.ops.lifecycle import resolve_config
    from coordinator.sim.simulate import FleetSpec, simulate
    from edge_agent.factory import pick_device
    from models.cpu_threads import limit_cpu_threads
    from models.families import family_models

    if args.threads:
        limit_cpu_threads(args.threads)
    device = str(pick_device(args.device))
    data = "mnist" if args.data_root else "mnist5k"
    layers = read_layers(
        None,
        [],
        algorithm="fedvtc",
        rounds=args.rounds,
        run_dir=str(args.run_dir),
        min_agents=args.clients,
        seed=args.seed,
        fraction=args.fraction,
        deadline_s=86400.0,
        num_classes=10,
        run_id="fedvtc-paper",
        server_device=device,
    )
    layers["hyper"].update(hyper(args))
    cfg, previous = resolve_config(layers)  # a stored run resumes with its own settings
    fleet = FleetSpec(
        num_agents=args.clients,
        models=tuple(
            args.models.split(",") if args.models else family_models(args.family, args.clients)
        ),
        data=data,
        partition=f"dirichlet:{args.alpha}",
        feature_dim=980,
        image_size=28,
        global_test_size=args.global_test or (10000 if args.data_root else 1000),
        device=device,
        data_root=args.data_root,
    )
    print(
        f"{'resuming' if previous else 'starting'} {args.run_dir} on {device}: {data}, "
        f"K={args.clients} at {args.fraction:.0%}, T={args.rounds}, E={args.epochs}, "
        f"eta={args.lr:g}, S={args.synthetic_per_class}, models {sorted(set(fleet.models))}",
        flush=True,
    )
    t0 = time.time()
    result = simulate(cfg, fleet)
    summary = summarize(result.metrics, args.rounds)
    final = result.metrics[-1]["agents"].values()
    summary.update(
        command="python " + " ".join(sys.argv),
        device=device,
        data=data,
        wall_s=time.time() - t0,
        hyper=cfg.hyper,
        per_client_before_ft=[a.get("acc_global_before_ft") for a in final],
    )
    return summary


def report(s: dict[str, Any]) -> str:
    """The figures that decide Table 7: before/after fine-tuning, noise control, probe."""

    def pct(key: str) -> str:
        v = s.get(key)
        return "–" if v is None else f"{100 * v:.1f}"

    accs = [a for a in s["per_client_acc_global"] if a is not None]
    sd = statistics.stdev(accs) * 100 if len(accs) > 1 else 0.0
    sep = [r.get("diag_proto_sep") for r in s["rounds"] if r.get("diag_proto_sep") is not None]
    return "\n".join(
        [
            f"global test accuracy (%, mean over {len(accs)} clients; chance 10):",
            f"  before fine-tuning (round T) {pct('acc_global_before_ft')}",
            f"  after fine-tuning            {pct('acc_global')} (client sd {sd:.1f})",
            f"  noise control                {pct('acc_global_noise_control')}",
            f"  probe, averaged psi          {pct('probe_acc_global')}",
            f"  probe, own psi               {pct('probe_acc_global_own_gen')}",
            "prototype separation per round: " + ", ".join(f"{v:.2f}" for v in sep),
            f"MB {s['bytes_total'] / 1e6:.1f}, wall {s['wall_s']:.0f} s on {s['device']}",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    """Run (or resume) the paper-regime run, then print and store its summary."""
    args = parse_args(argv)
    out = args.out or args.run_dir / "summary.json"
    if out.is_file():  # a finished run is reported, never rerun
        summary = json.loads(out.read_text())
    else:
        summary = run(args)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=1, default=float) + "\n")
    print(report(summary))


if __name__ == "__main__":
    main()
