"""Export benchmarks: exporter choice over the zoo, and ORT vs PyTorch / fp32 vs fp16 vs int8.

Two parts, both writing Markdown tables to stdout (and JSON with ``--json``):

* ``exporters``: every registered model (logits head, default input size, BatchNorm statistics
  from random images) exported with the dynamo and the legacy torch exporter: success, export
  seconds, max |ONNX - PyTorch| and max |scores|.
* ``variants``: small zoo models trained for a few epochs on the toolkit's built-in datasets
  (``load_dataset``: ``digits`` for 8x8 models, ``mnist5k`` resized to the model's input and
  repeated to its channels otherwise), exported as fp32/fp16/int8-static/int8-dynamic: file
  size, held-out accuracy, ORT latency against PyTorch eager with the same head (batch 1 and
  32, one thread and all threads). ORT and eager are timed in alternating blocks, so load from
  other processes hits both alike and the speed-up ratio stays meaningful on a busy machine.

Run: ``python benchmarks/bench_export.py variants`` (or ``exporters``, or ``all``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

# Submodule imports: they also work when a stale editable install maps `export` to a
# namespace package (the package's lazy attributes need its __init__).
from export.exporter import export_model
from export.heads import with_head
from export.runtime import Session, latency_ms, make_session, run_batches
from export.variants import Variant, make_variant
from models import create_model, list_models, model_info
from models.checkpoint import HeadSpec
from protocol.errors import EdgeFLError

SMALL = [
    "mlp_xs",
    "mlp_s",
    "mlp_m",
    "mlp_l",
    "cnn_t1",
    "cnn_t2",
    "cnn_t3",
    "cnn_bn3",
    "cnn_gap",
    "cnn2",
    "cnn4",
    "resnet8",
    "resnet18",
]
VARIANTS: tuple[Variant, ...] = ("fp16", "int8-static", "int8-dynamic")


def local_data(
    size: tuple[int, int], chans: int, max_train: int, seed: int = 0
) -> tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A built-in dataset at ``size`` with ``chans`` channels, split 75/25 (train capped).

    8x8 models get ``digits`` (their native size); larger inputs get ``mnist5k`` resized
    (bilinear) to the model's side, since upsampled 8x8 digits carry no detail to learn from.
    """
    from edge_agent.data import load_dataset

    if size[0] != size[1]:
        raise ValueError(f"square inputs only, got {size}")
    name = "digits" if size == (8, 8) else "mnist5k"
    data = load_dataset(name, image_size=None if name == "digits" else size[0])
    x = np.repeat(data.x, chans, axis=1) if chans != data.x.shape[1] else data.x
    order = np.random.default_rng(seed).permutation(len(data.y))
    cut = int(0.75 * len(order))
    train_idx, test_idx = order[:cut][:max_train], order[cut:]
    return (name, x[train_idx], data.y[train_idx], x[test_idx], data.y[test_idx])


def train(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, epochs: int) -> float:
    """A few epochs of Adam; returns seconds."""
    start = time.perf_counter()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(yt), generator=gen).split(64):  # type: ignore[no-untyped-call]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(xt[idx]), yt[idx]).backward()  # type: ignore[no-untyped-call]
            opt.step()
    model.eval()
    return time.perf_counter() - start


def paired_latency_ms(
    sess: Session,
    module: torch.nn.Module,
    shape: tuple[int, ...],
    batch: int,
    threads: int,
    *,
    blocks: int = 6,
    per_block: int = 10,
) -> tuple[float, float]:
    """Median (ORT, eager) latency in ms, timed in alternating blocks on the same input.

    Each block starts with two untimed runs: both runtimes' worker threads spin for a while
    after a call, and the first call after a switch pays for the other's spinning.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = np.random.default_rng(0).random((batch, *shape), dtype=np.float32)
    xt, feed = torch.from_numpy(x), {sess.input_name: x}
    runs: dict[str, Callable[[], object]] = {
        "ort": lambda: sess.session.run(None, feed),
        "eager": lambda: module(xt),
    }
    times: dict[str, list[float]] = {"ort": [], "eager": []}
    try:
        with torch.inference_mode():
            for _ in range(blocks):
                for key, run in runs.items():
                    run()
                    run()
                    for _ in range(per_block):
                        t0 = time.perf_counter()
                        run()
                        times[key].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(previous)
    return (1000.0 * statistics.median(times["ort"]), 1000.0 * statistics.median(times["eager"]))


def bench_variants(
    names: list[str], epochs: int, epochs_large: int, max_train: int, all_threads: int
) -> list[dict[str, Any]]:
    """Train, export and measure each model; one row per model."""
    rows = []
    for name in names:
        cfg = model_info(name)
        size, chans = cfg.input_size, cfg.in_chans
        dataset, xtr, ytr, xte, yte = local_data(size, chans, max_train)
        torch.manual_seed(0)
        model = create_model(name, num_classes=10, in_chans=chans, input_size=size)
        secs = train(model, xtr, ytr, epochs if size == (8, 8) else epochs_large)
        shape = (chans, *size)
        ref = with_head(model, HeadSpec("logits"))
        with tempfile.TemporaryDirectory() as tmp:
            res = export_model(
                model, HeadSpec("logits"), Path(tmp, "model.onnx"), input_shape=shape
            )
            row: dict[str, Any] = {
                "model": name,
                "input": list(shape),
                "dataset": dataset,
                "train_n": len(ytr),
                "test_n": len(yte),
                "train_s": round(secs, 1),
                "params": sum(p.numel() for p in model.parameters()),
            }
            with torch.inference_mode():
                row["torch_acc"] = float((ref(torch.from_numpy(xte))[1].numpy() == yte).mean())
            files: dict[str, Path] = {"fp32": res.path}
            for variant in VARIANTS:
                files[variant] = make_variant(
                    variant, res.path, Path(tmp, f"{variant}.onnx"), calibration=xtr
                )
            for label, path in files.items():
                one = make_session(path, threads=1)
                _, pred = run_batches(one, xte)
                row[f"{label}_bytes"] = path.stat().st_size
                row[f"{label}_acc"] = float((pred == yte).mean())
                row[f"{label}_b1_1t"] = latency_ms(one, shape, batch=1)
            sessions = {
                "1t": (make_session(res.path, threads=1), 1),
                "all": (make_session(res.path, threads=all_threads), all_threads),
            }
            for batch in (1, 32):
                for label, (sess, threads) in sessions.items():
                    ort_ms, eager_ms = paired_latency_ms(sess, ref, shape, batch, threads)
                    row[f"ort_b{batch}_{label}"] = ort_ms
                    row[f"eager_b{batch}_{label}"] = eager_ms
        rows.append(row)
        print(f"# {name} done", file=sys.stderr, flush=True)
    return rows


def bench_exporters(names: list[str]) -> list[dict[str, Any]]:
    """Export every model with both exporters; one row per model and exporter."""
    rows = []
    for name in names:
        cfg = model_info(name)
        shape = (cfg.in_chans, *cfg.input_size)
        torch.manual_seed(0)
        model = create_model(name, num_classes=10, in_chans=cfg.in_chans)
        x = np.random.default_rng(0).random((8, *shape), dtype=np.float32)
        calibrate_batchnorm(model, np.random.default_rng(1).random((32, *shape), dtype=np.float32))
        with torch.inference_mode():
            ref = with_head(model, HeadSpec("logits"))(torch.from_numpy(x))[0].numpy()
        for exporter in ("dynamo", "legacy"):
            row: dict[str, Any] = {"model": name, "exporter": exporter}
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    res = export_model(
                        model,
                        HeadSpec("logits"),
                        Path(tmp, "m.onnx"),
                        input_shape=shape,
                        dynamo=exporter == "dynamo",
                    )
                    scores, _ = run_batches(make_session(res.path), x)
                    row.update(
                        ok=True,
                        seconds=round(res.seconds, 2),
                        max_diff=float(np.abs(scores - ref).max()),
                        max_score=float(np.abs(ref).max()),
                        nodes=_count_nodes(res.path),
                    )
                except EdgeFLError as exc:
                    row.update(ok=False, error=str(exc)[:200])
            rows.append(row)
            print(f"# {name} {exporter}: {row}", file=sys.stderr, flush=True)
    return rows


@torch.no_grad()
def calibrate_batchnorm(model: torch.nn.Module, x: np.ndarray) -> None:
    """BatchNorm running statistics from ``x``, then eval mode.

    Fresh deep networks are degenerate in eval mode (ResNet-152 logits ~1e7, EfficientNet,
    GoogLeNet and MobileNet features ~1e-12), which would make the ONNX-vs-PyTorch difference
    meaningless; tests/export/export_helpers.py has the same helper.
    """
    for bn in model.modules():
        if isinstance(bn, torch.nn.modules.batchnorm._BatchNorm):
            bn.reset_running_stats()
            bn.momentum = None
    model.train()
    for start in range(0, len(x), 16):
        model(torch.from_numpy(x[start : start + 16]))
    model.eval()


def _count_nodes(path: Path) -> int:
    import onnx

    return len(onnx.load(str(path)).graph.node)


def exporters_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per model, the two exporters side by side."""
    out = [
        "| model | max \\|score\\| | dynamo s | dynamo max diff | dynamo nodes | legacy s "
        "| legacy max diff | legacy nodes |",
        "| --- " + "| ---: " * 7 + "|",
    ]
    by_model: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_model.setdefault(r["model"], {})[r["exporter"]] = r
    for name, ex in by_model.items():
        scale = next((r["max_score"] for r in ex.values() if r.get("ok")), float("nan"))
        cells = [f"{scale:.2g}"]
        for e in ("dynamo", "legacy"):
            r = ex.get(e, {})
            cells += (
                [f"{r['seconds']:.1f}", f"{r['max_diff']:.1e}", str(r["nodes"])]
                if r.get("ok")
                else ["FAIL", r.get("error", "")[:60], ""]
            )
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def variants_tables(rows: list[dict[str, Any]]) -> str:
    """Markdown: latency table (ms, speed-up = eager / ORT) and size/accuracy table."""
    lat = [
        "| model | ORT b1 1t | eager b1 1t | speed-up | ORT b1 all | eager b1 all | speed-up "
        "| ORT b32 1t | eager b32 1t | speed-up | ORT b32 all | eager b32 all | speed-up |",
        "| --- " + "| ---: " * 12 + "|",
    ]
    size = [
        "| model | data (train/test) | params | fp32 KB | fp16 KB | int8-s KB (ratio) "
        "| int8-d KB (ratio) | torch acc | fp32 acc | fp16 acc | int8-s acc (drop) "
        "| int8-d acc (drop) | b1 1t ms fp32/fp16/int8-s/int8-d |",
        "| --- | --- " + "| ---: " * 10 + "| --- |",
    ]
    for r in rows:
        cells = []
        for key in ("b1_1t", "b1_all", "b32_1t", "b32_all"):
            ort_ms, eager_ms = r[f"ort_{key}"], r[f"eager_{key}"]
            cells += [f"{ort_ms:.3f}", f"{eager_ms:.3f}", f"{eager_ms / ort_ms:.1f}x"]
        lat.append(f"| {r['model']} {'x'.join(map(str, r['input']))} | " + " | ".join(cells) + " |")
        kb = {v: r[f"{v}_bytes"] / 1024 for v in ("fp32", *VARIANTS)}
        cells = [
            r["model"],
            f"{r['dataset']} ({r['train_n']}/{r['test_n']})",
            f"{r['params']:,}",
            f"{kb['fp32']:.1f}",
            f"{kb['fp16']:.1f}",
        ]
        cells += [
            f"{kb[v]:.1f} ({kb[v] / kb['fp32']:.2f})" for v in ("int8-static", "int8-dynamic")
        ]
        cells += [f"{r['torch_acc']:.2%}", f"{r['fp32_acc']:.2%}", f"{r['fp16_acc']:.2%}"]
        cells += [
            f"{r[f'{v}_acc']:.2%} ({100 * (r['fp32_acc'] - r[f'{v}_acc']):+.1f} pt)"
            for v in ("int8-static", "int8-dynamic")
        ]
        cells.append("/".join(f"{r[f'{v}_b1_1t']:.3f}" for v in ("fp32", *VARIANTS)))
        size.append("| " + " | ".join(cells) + " |")
    return "\n".join(lat) + "\n\n" + "\n".join(size)


def main(argv: list[str] | None = None) -> int:
    """Run the chosen part(s) and print Markdown."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("part", choices=("variants", "exporters", "all"))
    p.add_argument("--models", nargs="*", default=None, help="model names (default: per part)")
    p.add_argument("--epochs", type=int, default=20, help="epochs for 8x8 models (digits)")
    p.add_argument("--epochs-large", type=int, default=2, help="epochs for larger inputs (mnist5k)")
    p.add_argument("--max-train", type=int, default=2000, help="training images at most")
    p.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="'all threads' count (default: torch's)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write raw rows here")
    args = p.parse_args(argv)
    raw: dict[str, Any] = {
        "torch": torch.__version__,
        "threads": args.threads,
        "loadavg_start": os.getloadavg(),
    }
    if args.part in ("exporters", "all"):
        raw["exporters"] = bench_exporters(args.models or list_models())
        print(exporters_table(raw["exporters"]) + "\n")
    if args.part in ("variants", "all"):
        raw["variants"] = bench_variants(
            args.models or SMALL, args.epochs, args.epochs_large, args.max_train, args.threads
        )
        print(variants_tables(raw["variants"]))
    raw["loadavg_end"] = os.getloadavg()
    print(
        f"\nload average (1/5/15 min) at start {raw['loadavg_start']}, at end "
        f"{raw['loadavg_end']}; {os.cpu_count()} CPUs, 'all threads' = {args.threads}"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
