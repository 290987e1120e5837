"""Training-loop overhead: samples/s of the agent's loop vs a bare PyTorch loop.

Same model, same data (already on the device), same batch size, optimizer and number of steps.
The agent loop adds the hooks, the finite-loss check, the progress callback and the parameter
groups (it builds its own optimizer from the default group: the whole model, the config's SGD
or, with ``--optimizer adam``, Adam: Felo's, Velo's and FedType's edge default).

    python benchmarks/bench_trainloop.py --model cnn_t2 --image-size 28 --repeats 5
    python benchmarks/bench_trainloop.py --model hcnn2_1024 --batch-size 10 --optimizer adam
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from edge_agent.trainer import TensorData, make_optimizer, train_epochs
from models import create_model
from protocol.algorithms.local import LocalConfig


class CE:
    """The local-only algorithm's hooks (cross-entropy, nothing after the step)."""

    def step_loss(self, x, y, features, logits):  # type: ignore[no-untyped-def]
        return F.cross_entropy(logits, y)

    def after_step(self, x, y, features, logits):  # type: ignore[no-untyped-def]
        return None


def bare(model, data: TensorData, cfg: LocalConfig, opt, gen) -> float:  # type: ignore[no-untyped-def]
    """The plain loop; with ``cfg.mixed_precision`` the textbook autocast + GradScaler one."""
    scaler = torch.amp.GradScaler("cuda") if cfg.mixed_precision else None
    t0 = time.perf_counter()
    model.train()
    for x, y in data.batches(cfg.batch_size, gen):
        with torch.autocast("cuda", enabled=scaler is not None):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()  # type: ignore[no-untyped-call]  # torch stub
            opt.step()
        else:
            scaler.scale(loss).backward()  # type: ignore[no-untyped-call]  # torch stub
            scaler.step(opt)
            scaler.update()
    if data.x.is_cuda:  # the kernels queued by the last steps count too
        torch.cuda.synchronize()
    return len(data) / (time.perf_counter() - t0)


def agent(model, data: TensorData, cfg: LocalConfig, opt, gen) -> float:  # type: ignore[no-untyped-def]
    progress = []
    stats = train_epochs(  # builds the same SGD as ``opt`` from the default parameter group
        model,
        data,
        cfg,
        CE(),
        epochs=1,
        generator=gen,
        on_progress=lambda s, t, lo: progress.append(s),
    )
    return stats.samples_per_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="cnn_t2")
    p.add_argument("--image-size", type=int, default=28)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", action="store_true", help="agent loop with mixed precision (CUDA only)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    torch.manual_seed(0)
    data = TensorData(
        torch.rand(a.samples, 1, a.image_size, a.image_size, device=dev),
        torch.randint(0, 10, (a.samples,), device=dev),
    )
    lr = 0.01 if a.optimizer == "sgd" else 1e-3
    cfg = LocalConfig(batch_size=a.batch_size, lr=lr, optimizer=a.optimizer, mixed_precision=a.amp)
    results: dict[str, list[float]] = {"bare": [], "agent": []}
    for _ in range(a.repeats):  # interleaved so drift hits both equally
        for name, fn in (("bare", bare), ("agent", agent)):
            torch.manual_seed(1)
            model = create_model(
                a.model, num_classes=10, in_chans=1, feature_dim=64, input_size=a.image_size
            ).to(dev)
            opt = make_optimizer(list(model.parameters()), cfg)
            results[name].append(fn(model, data, cfg, opt, torch.Generator().manual_seed(0)))
    # Interference from other processes only ever slows a run down, so the best run of each
    # loop is the steadiest estimate of its cost; the median is shown next to it.
    b, g = statistics.median(results["bare"]), statistics.median(results["agent"])
    bb, gb = max(results["bare"]), max(results["agent"])
    print(
        "| model | input | batch | bare samples/s (median / best) "
        "| agent loop samples/s (median / best) | overhead (median / best) | optimizer | device |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {a.model} | {a.image_size}x{a.image_size} | {a.batch_size} | {b:,.0f} / {bb:,.0f} "
        f"| {g:,.0f} / {gb:,.0f} | {100 * (b - g) / b:+.1f}% / {100 * (bb - gb) / bb:+.1f}% "
        f"| {a.optimizer} | {a.device}{' amp' if a.amp else ''} |"
    )


if __name__ == "__main__":
    main()
