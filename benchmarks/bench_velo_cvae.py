"""Velo's server cost: what its CVAE training takes a round, and a run, in the reference tier.

Velo's coordinator trains its CVAE every round for ``cvae_epochs`` over every entry its
knowledge table keeps (up to ``history_cap`` a class), so a round's cost grows with the table.
This measures the CVAE's training throughput (sample-epochs per second, on one thread unless
``--threads``) at the algorithm's defaults and projects the CVAE's seconds over a run from the
split file: each round adds one class mean per (client, class) a client holds (the paper's
wire), or up to ``upload_samples`` individual features per (client, class) (the
``velo_samples`` arm), until the cap.

    python benchmarks/bench_velo_cvae.py                       # CPU, one thread
    python benchmarks/bench_velo_cvae.py --device cuda         # a GPU
    python benchmarks/bench_velo_cvae.py --md benchmarks/results/velo_cvae.md   # and a file
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import experiment
import numpy as np
import torch

from coordinator.strategies.felo.cvae import cvae_loss_fn
from edge_agent.data.loaders import load_dataset
from edge_agent.data.partition_file import load_partition_file
from models import CVAE
from models.fit import fit
from models.optim import adam
from protocol.algorithms.felo import VeloConfig

ROOT = Path(__file__).resolve().parents[1]


def per_round_entries(split: Path, upload_samples: int, num_classes: int) -> np.ndarray:
    """Entries a round adds to each class's table with every client taking part."""
    labels = np.asarray(load_dataset("mnist5k").y)
    out = np.zeros(num_classes, np.int64)
    for idx in load_partition_file(split).train:
        counts = np.bincount(labels[idx], minlength=num_classes)
        held = counts > 0
        out += np.minimum(counts, upload_samples) if upload_samples else held
    return out


def run_seconds(per_round: np.ndarray, cap: int, rounds: int, epochs: int, rate: float) -> float:
    """CVAE seconds over ``rounds``: round r trains ``epochs`` over min(cap, r x added)."""
    entries = sum(int(np.minimum(cap, r * per_round).sum()) for r in range(1, rounds + 1))
    return epochs * entries / rate


def build(cfg: VeloConfig, feature_dim: int) -> CVAE:
    """The coordinator's CVAE at ``cfg``'s sizes, for ten classes."""
    return CVAE(
        feature_dim, 10, z_dim=cfg.cvae_z_dim, embed_dim=cfg.cvae_embed_dim, hidden=cfg.cvae_hidden
    )


def throughput(cfg: VeloConfig, feature_dim: int, entries: int, device: str) -> float:
    """Sample-epochs per second of one CVAE training event over ``entries`` random features."""
    gen = torch.Generator().manual_seed(0)
    cvae = build(cfg, feature_dim)
    x, y = torch.randn(entries, feature_dim, generator=gen), torch.randint(0, 10, (entries,))
    t0 = time.perf_counter()
    fit(
        cvae,
        (x, y),
        cvae_loss_fn(cfg.cvae_loss),
        epochs=1,
        batch_size=cfg.cvae_batch_size,
        lr=cfg.cvae_lr,
        generator=gen,
        device=device,
    )
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return entries / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--split", default="benchmarks/splits/mnist5k_dir1.0_c20_s1.npz")
    p.add_argument("--feature-dim", type=int, default=512, help="htfl_cnn's pooled features")
    p.add_argument("--rounds", type=int, default=100, help="the reference tier's cap")
    p.add_argument("--entries", type=int, default=2000, help="features a timed epoch trains on")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--md", help="also write the figures to this markdown file")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cfg = VeloConfig()
    rates = [throughput(cfg, a.feature_dim, a.entries, a.device) for _ in range(a.repeats)]
    rate = max(rates)  # interference only slows a run down: the best is the steadiest
    model = build(cfg, a.feature_dim)
    params = sum(t.numel() for t in model.parameters())
    kernel = "fused" if adam(model.parameters(), cfg.cvae_lr).defaults["fused"] else "loop"
    lines = [
        f"CVAE {params / 1e6:.2f} M parameters, batch {cfg.cvae_batch_size}, {a.device} "
        f"({a.threads} thread(s)), Adam {kernel}, torch {torch.__version__}: {rate:,.0f} "
        f"sample-epochs/s (best of {a.repeats}; median {statistics.median(rates):,.0f}) "
        f"over {a.entries} entries",
        "",
        f"| arm | entries added a round | table at round {a.rounds} | "
        f"CVAE s, round {a.rounds} | CVAE h, {a.rounds} rounds |",
        "|---|---|---|---|---|",
    ]
    arms = experiment.load_preset("reference").arms  # the tier's two Velo arms
    for arm in ("velo", "velo_samples"):
        upload = int(arms[arm].hyper.get("upload_samples", 0))
        added = per_round_entries(ROOT / a.split, upload, 10)
        table = int(np.minimum(cfg.history_cap, a.rounds * added).sum())
        last = cfg.cvae_epochs * table / rate
        total = run_seconds(added, cfg.history_cap, a.rounds, cfg.cvae_epochs, rate)
        lines.append(
            f"| `{arm}` | {int(added.sum()):,} | {table:,} | {last:,.0f} | {total / 3600:.1f} |"
        )
    print("\n".join(lines))
    if a.md:
        command = "python benchmarks/bench_velo_cvae.py " + " ".join(sys.argv[1:])
        head = f"# Velo's server CVAE: training throughput and its cost a run\n\n`{command}`\n\n"
        Path(a.md).write_text(head + "\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
