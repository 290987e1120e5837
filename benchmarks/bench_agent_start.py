"""Agent start-up per model family: launch -> registration received, and resident memory.

For each model, an ``edge-agent`` process is launched against a loopback Mosquitto that holds
a retained ``running`` coordinator state (so the agent registers at once); the time from
``Popen`` to its ``register`` message arriving at a subscriber is the start-up cost a device
pays, 99 % of it imports and model construction. RSS is read from ``/proc/PID/status`` right
after registration (``VmRSS``, idle before any training) with the peak (``VmHWM``).

Data: a small synthetic ``.npz`` (3x32x32 uint8 images, 10 classes) so that only the model's
own imports count; ``--digits`` adds a run on the built-in ``digits`` set (scikit-learn).

Usage::

    python benchmarks/bench_agent_start.py --models cnn4 mlp_s resnet8 mobilenet_v2 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ingest import RawMqtt  # sibling benchmark module

FEDERATION = "startbench"
DEFAULT_MODELS = ["mlp_s", "cnn4", "resnet8", "mobilenet_v2", "shufflenet_v2", "googlenet"]


def _agent_cmd() -> list[str]:
    exe = shutil.which("edge-agent", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "edge_agent.cli"]


def _proc_status(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    with Path(f"/proc/{pid}/status").open() as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) // 1024  # kB -> MiB
    return out


def _retain_running_state(port: int) -> None:
    from protocol.contract.codec import Envelope, encode
    from protocol.contract.messages import CoordinatorState
    from protocol.contract.topics import Topics

    body = CoordinatorState(
        state="running", run_id="start", algorithm="fedproto", round=1, total_rounds=10
    )
    frame = encode(Envelope(body=body, sender="coordinator", federation=FEDERATION))
    pub = RawMqtt(port, "startbench-coord")
    pub.publish_many([(Topics(FEDERATION).coord_state, frame)], qos=1, retain=True)
    time.sleep(0.2)
    pub.close()


def one_start(port: int, model: str, data: str, tmp: Path, timeout: float) -> dict[str, Any]:
    """Launch one agent and time it to its registration; its memory then."""
    sub = RawMqtt(port, f"startbench-sub-{model}-{time.monotonic_ns()}")
    sub.subscribe(f"edgefl/v1/{FEDERATION}/dev/+/up/register", 1)
    done: dict[str, float] = {}

    def wait() -> None:
        sub.consume(lambda _t, _p: bool(done.setdefault("at", time.perf_counter())) and False)

    threading.Thread(target=wait, daemon=True).start()
    cmd = [
        *_agent_cmd(),
        "--broker",
        f"127.0.0.1:{port}",
        "--id",
        f"dev-{model}".replace("_", "-"),
        "--federation",
        FEDERATION,
        "--algorithm",
        "fedproto",
        "--model",
        model,
        "--data",
        data,
        "--no-export",
        "--no-signing",
        "--state-dir",
        str(tmp / f"state-{model}"),
        "--threads",
        "1",
        "--log-level",
        "WARNING",
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while "at" not in done and time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                err = proc.stderr.read().decode()[-800:] if proc.stderr else ""
                raise RuntimeError(f"{model}: agent exited {proc.returncode}: {err}")
            time.sleep(0.005)
        if "at" not in done:
            raise RuntimeError(f"{model}: no registration within {timeout} s")
        mem = _proc_status(proc.pid)
    finally:
        proc.kill()
        proc.wait()
        sub.close()
    return {"start_s": done["at"] - t0, "rss_mib": mem.get("VmRSS"), "hwm_mib": mem.get("VmHWM")}


def synthetic_npz(path: Path, n: int = 200) -> Path:
    """A tiny 3x32x32 dataset, so only the model's own imports are measured."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8)
    y = rng.integers(0, 10, size=n)
    np.savez(path, x=x, y=y)
    return path


def main(argv: list[str] | None = None) -> None:
    """Print a markdown table: model, family, start-up time (median), RSS and peak."""
    from coordinator.broker.embedded import MosquittoBroker
    from models import model_info

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--digits", action="store_true", help="also mlp_s on the digits dataset")
    args = ap.parse_args(argv)
    runs = [(m, "synthetic") for m in args.models]
    if args.digits:
        runs.append(("mlp_s", "digits"))
    print(f"load before: {os.getloadavg()}")
    rows = []
    with MosquittoBroker() as broker, tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        npz = str(synthetic_npz(tmp / "synthetic.npz"))
        _retain_running_state(broker.port)
        for model, data in runs:
            res = [
                one_start(
                    broker.port, model, npz if data == "synthetic" else data, tmp, args.timeout
                )
                for _ in range(args.repeat)
            ]
            family = getattr(model_info(model), "family", "?")
            row = {
                "model": model,
                "family": family,
                "data": data,
                "start_s": statistics.median(r["start_s"] for r in res),
                "rss_mib": statistics.median(r["rss_mib"] for r in res),
                "hwm_mib": max(r["hwm_mib"] for r in res),
                "all_s": [round(r["start_s"], 2) for r in res],
            }
            rows.append(row)
            print(row, flush=True)
    print(f"load after: {os.getloadavg()}")
    print("\n| model | family | data | launch -> registered (median) | RSS idle | peak RSS |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['family']} | {r['data']} | {r['start_s']:.2f} s "
            f"{r['all_s']} | {r['rss_mib']} MiB | {r['hwm_mib']} MiB |"
        )


if __name__ == "__main__":
    main()
