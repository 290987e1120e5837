"""Size, compute and CPU latency of every registered classifier at its default input size.

Usage::

    python benchmarks/bench_models.py                      # all models, markdown table
    python benchmarks/bench_models.py --pattern 'cnn*' --threads 2 --repeats 5

Multiply-accumulates are counted with forward hooks on Conv2d, ConvTranspose2d and Linear
(everything else, e.g. BatchNorm, activations and pooling, is ignored: it is a small fraction
and not what the usual MAC figures count). Latency is the median over ``--repeats`` timed
forwards in ``torch.inference_mode`` after one warm-up, at batch 1 and 32.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import models


@dataclass(frozen=True)
class Row:
    """One benchmark line."""

    name: str
    family: str
    input_shape: tuple[int, int, int]
    params: int
    num_features: int
    macs: int
    ms_b1: float
    ms_b32: float


def count_macs(model: nn.Module, x: Tensor) -> int:
    """Multiply-accumulates of one forward of ``x`` (batch 1) through conv/linear layers."""
    total = 0

    def hook(m: nn.Module, inputs: tuple[Tensor, ...], out: Tensor) -> None:
        nonlocal total
        if isinstance(m, nn.Conv2d):
            kh, kw = m.kernel_size
            total += out.numel() * (m.in_channels // m.groups) * kh * kw
        elif isinstance(m, nn.ConvTranspose2d):
            kh, kw = m.kernel_size
            total += inputs[0].numel() * (m.out_channels // m.groups) * kh * kw
        elif isinstance(m, nn.Linear):
            total += out.numel() * m.in_features

    counted = (nn.Conv2d, nn.ConvTranspose2d, nn.Linear)
    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, counted)]
    try:
        with torch.inference_mode():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return total


def latency_ms(model: nn.Module, x: Tensor, repeats: int) -> float:
    """Median wall time of one forward, in milliseconds."""
    with torch.inference_mode():
        model(x)  # warm-up: allocator, oneDNN primitive caches
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(x)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bench(name: str, repeats: int) -> Row:
    """Benchmark one registered model at its default input size with 10 classes."""
    cfg = models.model_info(name)
    torch.manual_seed(0)
    model = models.create_model(name, num_classes=10, in_chans=cfg.in_chans).eval()
    shape = (cfg.in_chans, *cfg.input_size)
    one = torch.rand(1, *shape)
    return Row(
        name=name,
        family=cfg.family,
        input_shape=shape,
        params=sum(p.numel() for p in model.parameters()),
        num_features=model.num_features,
        macs=count_macs(model, one),
        ms_b1=latency_ms(model, one, repeats),
        ms_b32=latency_ms(model, torch.rand(32, *shape), max(1, repeats // 2)),
    )


def markdown(rows: list[Row]) -> str:
    """The rows as a markdown table, grouped by family, smallest first."""
    lines = [
        "| model | family | input C×H×W | params | features | MACs | ms batch 1 | ms batch 32 |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in sorted(rows, key=lambda r: (r.family, r.params)):
        c, h, w = r.input_shape
        lines.append(
            f"| `{r.name}` | {r.family} | {c}×{h}×{w} | {_si(r.params)} | {r.num_features} "
            f"| {_si(r.macs)} | {r.ms_b1:.2f} | {r.ms_b32:.1f} |"
        )
    return "\n".join(lines)


def _si(n: int) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def main() -> None:
    """Parse arguments, benchmark, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pattern", default="*", help="fnmatch pattern over registry names")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards at batch 1")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in models.list_models(args.pattern):
        rows.append(bench(name, args.repeats))
        print(f"# done {name}", flush=True)
    print(
        f"\ntorch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{args.threads} thread(s), median of {args.repeats} (batch 1) / "
        f"{max(1, args.repeats // 2)} (batch 32) forwards\n"
    )
    print(markdown(rows))


if __name__ == "__main__":
    main()
