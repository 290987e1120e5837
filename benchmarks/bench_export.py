"""Export benchmarks: exporter choice over the zoo, and ORT vs PyTorch / fp32 vs fp16 vs int8.

Two parts, both writing Markdown tables to stdout (and JSON with ``--json``):

* ``exporters``: every registered model (logits head, default input size) exported with the
  dynamo and the legacy torch exporter: success, export seconds, max |ONNX - PyTorch|.
* ``variants``: small zoo models (and resnet18 at 32 px) trained for a few epochs on sklearn's
  digits (x/16; 1x8x8, upsampled and/or repeated to the model's input size), then exported
  as fp32/fp16/int8-static/int8-dynamic: file size, test accuracy, ORT latency (batch 1 and
  32, one thread and all threads) against PyTorch eager (with the same head).

Run: ``python benchmarks/bench_export.py variants`` (or ``exporters``, or ``all``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

# Submodule imports: they also work when a stale editable install maps `export` to a
# namespace package (the package's lazy attributes need its __init__).
from export.exporter import export_model
from export.heads import with_head
from export.runtime import latency_ms, make_session, run_batches
from export.variants import make_variant
from models import create_model, list_models, model_info
from models.checkpoint import HeadSpec
from protocol.errors import EdgeFLError

SMALL = ["mlp_xs", "mlp_s", "mlp_m", "mlp_l", "cnn_t1", "cnn_t2", "cnn_t3", "cnn_bn3",
         "cnn_gap", "cnn2", "cnn4", "resnet18"]
VARIANTS = ("fp16", "int8-static", "int8-dynamic")


def digits(size: tuple[int, int], chans: int, seed: int = 0
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """sklearn digits in [0, 1] resized to ``size`` with ``chans`` channels; 75/25 split."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    t = torch.from_numpy((x / 16.0).astype(np.float32)).view(-1, 1, 8, 8)
    if size != (8, 8):
        t = F.interpolate(t, size=size, mode="bilinear", align_corners=False).clamp(0, 1)
    t = t.repeat(1, chans, 1, 1)
    order = np.random.default_rng(seed).permutation(len(y))
    cut = int(0.75 * len(y))
    xa, ya = t.numpy()[order], y[order].astype(np.int64)
    return xa[:cut], ya[:cut], xa[cut:], ya[cut:]


def train(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, epochs: int) -> float:
    """A few epochs of Adam; returns seconds."""
    start = time.perf_counter()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(yt), generator=gen).split(64):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(xt[idx]), yt[idx]).backward()
            opt.step()
    model.eval()
    return time.perf_counter() - start


def torch_latency_ms(module: torch.nn.Module, shape: tuple[int, ...], batch: int,
                     threads: int, repeats: int = 50) -> float:
    """Median eager latency of ``module`` (with its head) on a random batch."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.rand(batch, *shape)
    try:
        with torch.inference_mode():
            for _ in range(5):
                module(x)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                module(x)
                times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(previous)
    return 1000.0 * statistics.median(times)


def bench_variants(names: list[str], epochs: int, all_threads: int) -> list[dict[str, Any]]:
    """Train, export and measure each model; one row per model."""
    rows = []
    for name in names:
        cfg = model_info(name)
        size, chans = cfg.input_size, cfg.in_chans
        xtr, ytr, xte, yte = digits(size, chans)
        torch.manual_seed(0)
        model = create_model(name, num_classes=10, in_chans=chans, input_size=size)
        secs = train(model, xtr, ytr, epochs if name != "resnet18" else max(1, epochs // 2))
        shape = (chans, *size)
        ref = with_head(model, HeadSpec("logits"))
        with tempfile.TemporaryDirectory() as tmp:
            res = export_model(model, HeadSpec("logits"), Path(tmp, "model.onnx"),
                               input_shape=shape)
            row: dict[str, Any] = {"model": name, "input": list(shape), "train_s": round(secs, 1),
                                   "params": sum(p.numel() for p in model.parameters())}
            with torch.inference_mode():
                row["torch_acc"] = float((ref(torch.from_numpy(xte))[1].numpy() == yte).mean())
            files = {"fp32": res.path}
            for variant in VARIANTS:
                files[variant] = make_variant(variant, res.path, Path(tmp, f"{variant}.onnx"),
                                              calibration=xtr)
            for variant, path in files.items():
                one = make_session(path, threads=1)
                _, pred = run_batches(one, xte)
                row[f"{variant}_bytes"] = path.stat().st_size
                row[f"{variant}_acc"] = float((pred == yte).mean())
                row[f"{variant}_b1_1t"] = latency_ms(one, shape, batch=1)
            one = make_session(res.path, threads=1)
            allt = make_session(res.path, threads=all_threads)
            for batch in (1, 32):
                row[f"ort_b{batch}_1t"] = latency_ms(one, shape, batch=batch)
                row[f"ort_b{batch}_all"] = latency_ms(allt, shape, batch=batch)
                row[f"eager_b{batch}_1t"] = torch_latency_ms(ref, shape, batch, 1)
                row[f"eager_b{batch}_all"] = torch_latency_ms(ref, shape, batch, all_threads)
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
        model = create_model(name, num_classes=10, in_chans=cfg.in_chans).eval()
        x = np.random.default_rng(0).random((8, *shape), dtype=np.float32)
        with torch.inference_mode():
            ref = with_head(model, HeadSpec("logits"))(torch.from_numpy(x))[0].numpy()
        for exporter in ("dynamo", "legacy"):
            row: dict[str, Any] = {"model": name, "exporter": exporter}
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    res = export_model(model, HeadSpec("logits"), Path(tmp, "m.onnx"),
                                       input_shape=shape, dynamo=exporter == "dynamo")
                    scores, _ = run_batches(make_session(res.path), x)
                    row.update(ok=True, seconds=round(res.seconds, 2),
                               max_diff=float(np.abs(scores - ref).max()),
                               nodes=_count_nodes(res.path))
                except EdgeFLError as exc:
                    row.update(ok=False, error=str(exc)[:200])
            rows.append(row)
            print(f"# {name} {exporter}: {row}", file=sys.stderr, flush=True)
    return rows


def _count_nodes(path: Path) -> int:
    import onnx

    return len(onnx.load(str(path)).graph.node)


def exporters_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per model, the two exporters side by side."""
    out = ["| model | dynamo s | dynamo max diff | dynamo nodes | legacy s | legacy max diff "
           "| legacy nodes |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    by_model: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_model.setdefault(r["model"], {})[r["exporter"]] = r
    for name, ex in by_model.items():
        cells = []
        for e in ("dynamo", "legacy"):
            r = ex.get(e, {})
            cells += ([f"{r['seconds']:.1f}", f"{r['max_diff']:.1e}", str(r["nodes"])]
                      if r.get("ok") else ["FAIL", r.get("error", "")[:60], ""])
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def variants_tables(rows: list[dict[str, Any]]) -> str:
    """Markdown: latency table and size/accuracy table."""
    lat = ["| model | ORT b1 1t | eager b1 1t | speed-up | ORT b1 all | eager b1 all | ORT b32 1t "
           "| eager b32 1t | ORT b32 all | eager b32 all |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    size = ["| model | params | fp32 KB | fp16 KB | int8-s KB (ratio) | int8-d KB | torch acc "
            "| fp32 acc | fp16 acc | int8-s acc (drop) | int8-d acc | b1 1t ms fp32/fp16/int8-s/"
            "int8-d |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
            "| ---: | --- |"]
    for r in rows:
        lat.append(
            f"| {r['model']} {'x'.join(map(str, r['input']))} | {r['ort_b1_1t']:.3f} | "
            f"{r['eager_b1_1t']:.3f} | {r['eager_b1_1t'] / r['ort_b1_1t']:.1f}x | "
            f"{r['ort_b1_all']:.3f} | {r['eager_b1_all']:.3f} | {r['ort_b32_1t']:.3f} | "
            f"{r['eager_b32_1t']:.3f} | {r['ort_b32_all']:.3f} | {r['eager_b32_all']:.3f} |"
        )
        kb = {v: r[f"{v}_bytes"] / 1024 for v in ("fp32", *VARIANTS)}
        drop = 100 * (r["fp32_acc"] - r["int8-static_acc"])
        size.append(
            f"| {r['model']} | {r['params']:,} | {kb['fp32']:.1f} | {kb['fp16']:.1f} | "
            f"{kb['int8-static']:.1f} ({kb['int8-static'] / kb['fp32']:.2f}) | "
            f"{kb['int8-dynamic']:.1f} | {r['torch_acc']:.2%} | {r['fp32_acc']:.2%} | "
            f"{r['fp16_acc']:.2%} | {r['int8-static_acc']:.2%} ({drop:+.1f} pt) | "
            f"{r['int8-dynamic_acc']:.2%} | "
            + "/".join(f"{r[f'{v}_b1_1t']:.3f}" for v in ("fp32", *VARIANTS)) + " |"
        )
    return "\n".join(lat) + "\n\n" + "\n".join(size)


def main(argv: list[str] | None = None) -> int:
    """Run the chosen part(s) and print Markdown."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("part", choices=("variants", "exporters", "all"))
    p.add_argument("--models", nargs="*", default=None, help="model names (default: per part)")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="'all threads' count (default: torch's)")
    p.add_argument("--json", type=Path, default=None, help="also write raw rows here")
    args = p.parse_args(argv)
    raw: dict[str, Any] = {"torch": torch.__version__, "threads": args.threads}
    if args.part in ("exporters", "all"):
        raw["exporters"] = bench_exporters(args.models or list_models())
        print(exporters_table(raw["exporters"]) + "\n")
    if args.part in ("variants", "all"):
        raw["variants"] = bench_variants(args.models or SMALL, args.epochs, args.threads)
        print(variants_tables(raw["variants"]))
    if args.json is not None:
        args.json.write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
