"""Several processes storing replies: one shared SQLite store (WAL, the write lock taken in
turn) against one store file per process, with the coordinator's own ``Store`` and its
``synchronous=FULL`` group commits (the coordinator's ingest workers).

Each of K writer processes stores ``--replies`` FedProto-sized blobs (8.5 KB) in transactions
of ``--batch`` replies (the group commit of a burst), through ``Store.add_update`` as the
workers do. Printed per K and layout: stored replies per second over all writers (first start
-> last finish), and each writer's time waiting for the write lock.

Usage::

    python benchmarks/bench_store_writers.py --writers 1 2 3 --replies 3000 --batch 64
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def writer(  # noqa: PLR0917 - a process target takes positional arguments
    path: str, k: int, replies: int, batch: int, go: Any, out: Any
) -> None:
    """Child process: store ``replies`` blobs in transactions of ``batch``."""
    from coordinator.store.database import Store

    store = Store(path)
    blob = os.urandom(8450)
    wait = 0.0
    go.wait()
    t0 = time.perf_counter()
    for start in range(0, replies, batch):
        w0 = time.perf_counter()
        with store.transaction():
            wait += time.perf_counter() - w0
            for i in range(start, min(start + batch, replies)):
                store.add_update(0, f"w{k}-dev{i:05d}", f"w{k}-{i}", "t", blob)
    out.put((t0, time.perf_counter(), wait))
    store.close()


def run(writers: int, shared: bool, replies: int, batch: int, where: str | None) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        paths = [
            str(Path(tmp) / ("state.sqlite" if shared else f"w{k}.sqlite")) for k in range(writers)
        ]
        procs = [
            ctx.Process(target=writer, args=(paths[k], k, replies, batch, go, out))
            for k in range(writers)
        ]
        for p in procs:
            p.start()
        time.sleep(1.0)  # let them import and open their stores
        go.set()
        spans = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
    start, end = min(s[0] for s in spans), max(s[1] for s in spans)
    return {
        "writers": writers,
        "layout": "shared" if shared else "per-writer",
        "replies_per_s": writers * replies / (end - start),
        "lock_wait_s": [round(s[2], 3) for s in spans],
    }


def main(argv: list[str] | None = None) -> None:
    """Print one markdown row per (writers, layout), with the load average."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--writers", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--replies", type=int, default=3000, help="per writer")
    ap.add_argument("--batch", type=int, default=64, help="replies per transaction")
    ap.add_argument("--store-dir", default=None, help="where the stores live (default: tmp)")
    args = ap.parse_args(argv)
    print("| writers | layout | replies/s (all writers) | lock wait per writer | load 1-min |")
    print("|---|---|---|---|---|")
    for k in args.writers:
        for shared in (True, False):
            r = run(k, shared, args.replies, args.batch, args.store_dir)
            waits = ", ".join(f"{w:.2f} s" for w in r["lock_wait_s"])
            print(
                f"| {k} | {r['layout']} | {r['replies_per_s']:,.0f} | {waits} | "
                f"{os.getloadavg()[0]:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
