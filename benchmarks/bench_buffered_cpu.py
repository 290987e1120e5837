"""The coordinator's CPU time per accepted reply, buffered against synchronous rounds.

Setting: ``--agents`` in-process agents (``coordinator.sim.simulate``, each with its own MQTT
client) over a loopback Mosquitto, Dirichlet 0.5 on ``--data``, full participation. Per
algorithm the same fleet runs ``run.mode = "sync"`` (``--rounds`` rounds of ``--agents`` replies)
and ``run.mode = "buffered"`` (``--buffer-size`` replies a global version, as many versions as
give the same number of replies). Algorithms: FedAvg on one architecture (``homo_mlp``: whole
models), FedProto (a prototype table) and Felo (features, logits and per-architecture weight
groups) on the heterogeneous ``tiny`` family.

Measured: the CPU time of the engine's thread (``time.thread_time``, read in that thread by a
:class:`~coordinator.engine.observer.RunObserver`) from the first training step's opening to the
last training step's close, divided by the replies those steps folded. That is the work the two
modes do differently: the reply checks, the durable write and the ack of each reply, and each
step's aggregation, persistence and task building (a buffered run has ``agents / buffer-size``
times as many steps per reply). Not in it: the coordinator's MQTT client thread (reading and
decoding frames, the same per reply in both modes), the agents' threads (training) and the
broker; a stale reply refused is work without an accepted reply (counted in the table).

Results: ``benchmarks/results/bench_buffered_cpu.json`` and ``.md`` (this script writes both,
with the command line).

Usage::

    python benchmarks/bench_buffered_cpu.py --agents 16 --rounds 10 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from coordinator.engine.observer import NoObserver
from coordinator.strategies import Step

RESULTS = Path(__file__).resolve().parent / "results"
FAMILIES = {"fedavg": "homo_mlp", "fedproto": "tiny", "felo": "tiny"}
MODES = ("sync", "buffered")


class EngineCpu(NoObserver):
    """The engine thread's CPU time over the training steps, and the replies they folded."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.end = 0.0
        self.replies = 0
        self.steps = 0
        self.stale_refused = 0

    def step_opened(self, idx: int, step: Step) -> None:
        if step.phase == "train" and self.start is None:
            self.start = time.thread_time()  # called on the engine's thread

    def step_closed(self, record: Mapping[str, Any]) -> None:
        if record["phase"] != "train":
            return
        self.end = time.thread_time()
        self.replies += len(record["agents"])
        self.steps += 1
        self.stale_refused += len(record.get("stale_refused", []))


def run_one(
    args: argparse.Namespace, algorithm: str, mode: str, port: int, repeat: int
) -> dict[str, Any]:
    """One run; its figures."""
    from coordinator.commands.simulate import simulate_feature_dim
    from coordinator.config import load_config
    from coordinator.engine.runner import mqtt_client
    from coordinator.sim.simulate import FleetSpec, simulate
    from models.families import family_models

    buffer_size = args.buffer_size or max(1, args.agents // 2)
    rounds = args.rounds if mode == "sync" else args.rounds * args.agents // buffer_size
    run_dir = Path(tempfile.mkdtemp(prefix=f"cpu-{algorithm}-{mode}-"))
    try:
        cfg = load_config(
            None,
            [],
            algorithm=algorithm,
            rounds=rounds,
            run_dir=str(run_dir / "run"),
            min_agents=args.agents,
            seed=args.seed,
            deadline_s=600.0,
            mode=mode,
            buffer_size=buffer_size,
            run_id="cpu",
            federation=f"cpu{algorithm}{mode}{repeat}",  # no retained state of another run
        )
        fleet = FleetSpec(
            num_agents=args.agents,
            models=tuple(family_models(FAMILIES[algorithm], args.agents)),
            data=args.data,
            partition="dirichlet:0.5",
            feature_dim=simulate_feature_dim(cfg, None),
            global_test_size=100,
        )
        cpu = EngineCpu()
        t0 = time.perf_counter()
        result = simulate(
            cfg,
            fleet,
            transport_factory=lambda cid, will: mqtt_client(cfg)(
                client_id=f"{cfg.federation}-{cid}", port=port, will=will, clean_session=True
            ),
            observer=cpu,
        )
        wall = time.perf_counter() - t0
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    train = [m for m in result.metrics if m["phase"] == "train"]
    engine_s = cpu.end - (cpu.start or cpu.end)
    return {
        "algorithm": algorithm,
        "mode": mode,
        "agents": args.agents,
        "buffer_size": buffer_size if mode == "buffered" else 0,
        "steps": cpu.steps,
        "replies": cpu.replies,
        "stale_refused": cpu.stale_refused,
        "engine_cpu_s": round(engine_s, 4),
        "engine_cpu_ms_per_reply": round(1e3 * engine_s / max(1, cpu.replies), 3),
        "bytes_per_reply": round(sum(m["bytes_total"] for m in train) / max(1, cpu.replies)),
        "wall_s": round(wall, 1),
    }


def write_results(rows: list[dict[str, Any]], command: str, load: list[float]) -> None:
    """``bench_buffered_cpu.json`` and a markdown table beside it (per algorithm and mode: the
    median over the repeats, and their range)."""
    RESULTS.mkdir(exist_ok=True)
    doc = {"command": command, "load_before": load, "runs": rows}
    (RESULTS / "bench_buffered_cpu.json").write_text(json.dumps(doc, indent=2) + "\n")
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["algorithm"], r["mode"]), []).append(r)
    med = {k: statistics.median(r["engine_cpu_ms_per_reply"] for r in g) for k, g in groups.items()}
    lines = [
        "# Coordinator CPU per accepted reply: buffered against sync",
        "",
        f"Command: `{command}` (1-minute load before: {load[0]}). CPU: the engine thread's "
        "`time.thread_time` over the training steps, per reply they folded "
        "(benchmarks/bench_buffered_cpu.py says what is in it and what is not); the median "
        "over the repeats, their range in brackets.",
        "",
        "| algorithm | mode | runs | steps | replies folded | stale refused | bytes/reply "
        "| engine CPU ms/reply | x sync |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (algorithm, mode), g in groups.items():
        per_reply = [r["engine_cpu_ms_per_reply"] for r in g]
        sync = med.get((algorithm, "sync"))
        ratio = f"{med[algorithm, mode] / sync:.2f}" if sync else "-"
        lines.append(
            f"| {algorithm} | {mode} | {len(g)} | {g[0]['steps']} | "
            f"{statistics.median(r['replies'] for r in g):.0f} | "
            f"{sum(r['stale_refused'] for r in g)} | "
            f"{statistics.median(r['bytes_per_reply'] for r in g):,.0f} | "
            f"{med[algorithm, mode]:.2f} [{min(per_reply):.2f}, {max(per_reply):.2f}] | {ratio} |"
        )
    (RESULTS / "bench_buffered_cpu.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4, help="synchronous rounds")
    ap.add_argument("--buffer-size", type=int, default=0, help="default: half the agents")
    ap.add_argument("--algorithms", default="fedavg,fedproto,felo")
    ap.add_argument("--data", default="digits")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each algorithm and mode")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the process")
    args = ap.parse_args(argv)
    from coordinator.broker.embedded import MosquittoBroker
    from models.cpu_threads import limit_cpu_threads

    limit_cpu_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    command = "python benchmarks/bench_buffered_cpu.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    load = [round(x, 2) for x in os.getloadavg()]
    rows = []
    with MosquittoBroker() as broker:
        for algorithm in args.algorithms.split(","):
            for repeat in range(args.repeats):
                for mode in MODES:  # interleaved: a change of load hits both modes alike
                    row = {**run_one(args, algorithm, mode, broker.port, repeat), "repeat": repeat}
                    print(row, flush=True)
                    rows.append(row)
    write_results(rows, command.strip(), load)
    print((RESULTS / "bench_buffered_cpu.md").read_text())


if __name__ == "__main__":
    main()
