"""Coordinator overhead per round with N protocol-only agents over a real loopback Mosquitto.

The coordinator (the real engine, store and ``fedproto`` strategy) runs in this process; the
fleet runs in a child process as N sending :class:`~protocol.endpoint.Endpoint` objects and one
receiving endpoint sharing one MQTT connection. Fake agents register like real ones and answer
every task at once with a realistic FedProto reply (prototypes of the 2-6 classes they hold,
``--dim`` float32 features each), so a round measures nothing but coordination: decoding,
validation, the durable SQLite write before each ack, aggregation, and dispatch of the next
round's tasks.

Figures per N (median over the rounds after the first):

* ``turnaround``: last reply sent -> last task of the next round received (the fleet's view
  of the time between rounds: ingest of the tail, aggregation, persistence, N task sends);
* ``first task``: last reply sent -> first task of the next round received;
* ``msgs/s``: coordinator messages (replies in, acks and tasks out) per second of round time;
* ``peak RSS``: the coordinator process's maximum resident set (``ru_maxrss``).

Usage::

    python benchmarks/bench_coordinator.py --agents 10 100 1000 --rounds 4
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import queue
import resource
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

FEDERATION = "bench"


def fleet_main(  # noqa: PLR0915, PLR0917 - one self-contained child process
    port: int, n: int, dim: int, num_classes: int, out: Any, stop: Any
) -> None:
    """Child process: N fake agents on one MQTT connection; reports per-round timestamps."""
    import numpy as np

    from protocol.endpoint import Endpoint
    from protocol.messages import Ack, Capabilities, InputSpec, Register, Reply, Status, Task
    from protocol.mqtt import MqttTransport
    from protocol.payloads import PrototypeSet
    from protocol.topics import Topics

    logging.basicConfig(level=logging.ERROR)
    topics = Topics(FEDERATION)
    transport = MqttTransport(client_id="fakefleet", port=port, clean_session=True)
    rng = np.random.default_rng(0)
    ids = [f"dev{i:04d}" for i in range(n)]
    held = {
        d: np.sort(rng.choice(num_classes, size=int(rng.integers(2, 7)), replace=False))
        for d in ids
    }
    tasks: queue.Queue[tuple[str, Task]] = queue.Queue()
    times: dict[str, Any] = {"task": {}, "reply": {}, "ack": {}}
    lock = threading.Lock()

    def stamp(kind: str, round_: int) -> None:
        now = time.perf_counter()
        with lock:
            first, _last, count = times[kind].get(round_, (now, now, 0))
            times[kind][round_] = (first, now, count + 1)

    def on_down(env: Any, topic: str) -> None:
        d = topics.device_from(topic)
        if d is None:
            return
        if isinstance(env.body, Task):
            stamp("task", env.body.round)
            tasks.put((d, env.body))
        elif isinstance(env.body, Ack):
            stamp("ack", int(env.body.task_id.split(".")[-3]))  # run.step.attempt.device

    # one receiving endpoint for the whole fleet (one wildcard subscription, so the fleet's own
    # dispatch stays O(1) per message); one sending endpoint per device for its sender id
    receiver = Endpoint(transport, sender="fleet", federation=FEDERATION)
    receiver.subscribe(f"{topics.base}/dev/+/down/#", on_down)
    endpoints = {d: Endpoint(transport, sender=d, federation=FEDERATION) for d in ids}
    transport.connect()
    for d in ids:
        endpoints[d].send(topics.status(d), Status(state="online"), retain=True)
        counts = {str(int(c)): int(rng.integers(20, 200)) for c in held[d]}
        endpoints[d].send(
            topics.up(d, "register"),
            Register(
                device_id=d,
                arch="resnet18",
                num_params=11_000_000,
                capabilities=Capabilities(device="cpu"),
                input_spec=InputSpec(3, 32, 32),
                num_classes=num_classes,
                class_counts=counts,
                algorithm="fedproto",
            ),
        )

    def worker() -> None:
        while not stop.is_set():
            try:
                d, task = tasks.get(timeout=0.2)
            except queue.Empty:
                continue
            if task.phase != "train":
                body = Reply(
                    task_id=task.task_id,
                    round=task.round,
                    phase=task.phase,
                    num_samples=100,
                    metrics={"acc_local": 0.5},
                )
            else:
                k = held[d]
                protos = PrototypeSet(
                    class_ids=k.astype(np.int32),
                    vectors=rng.standard_normal((len(k), dim), dtype=np.float32),
                    counts=np.full(len(k), 50, dtype=np.int32),
                )
                body = Reply(
                    task_id=task.task_id,
                    round=task.round,
                    phase=task.phase,
                    num_samples=int(50 * len(k)),
                    payloads={"protos": protos},
                    metrics={"acc_local": 0.5, "acc_global": 0.4, "train_loss": 1.0},
                )
            endpoints[d].send(topics.up(d, "reply"), body, round=task.round)
            stamp("reply", task.round)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    stop.wait()
    thread.join(timeout=5)
    with lock:
        out.put({k: dict(v) for k, v in times.items()})
    transport.close()


def run_one(n: int, rounds: int, dim: int, num_classes: int) -> dict[str, Any]:
    """One coordinator run with ``n`` fake agents; returns the figures for that N."""
    from coordinator.config import load_config
    from coordinator.runner import coordinator_will, run_coordinator
    from protocol.broker import MosquittoBroker
    from protocol.mqtt import MqttTransport

    ctx = mp.get_context("spawn")  # the child must not inherit our MQTT threads
    with MosquittoBroker() as broker, tempfile.TemporaryDirectory() as tmp:
        out, stop = ctx.Queue(), ctx.Event()
        fleet = ctx.Process(target=fleet_main, args=(broker.port, n, dim, num_classes, out, stop))
        fleet.start()
        cfg = load_config(
            None,
            [],
            algorithm="fedproto",
            rounds=rounds,
            run_dir=str(Path(tmp) / "run"),
            min_agents=n,
            fraction=1.0,
            deadline_s=600.0,
            num_classes=num_classes,
            federation=FEDERATION,
            run_id="bench",
            wait_agents_s=600.0,
        )
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        transport = MqttTransport(
            client_id="coordinator",
            port=broker.port,
            will=coordinator_will(cfg),
            clean_session=True,
        )
        t0 = time.perf_counter()
        result = run_coordinator(cfg, transport)
        wall = time.perf_counter() - t0
        transport.close()
        stop.set()
        times = out.get(timeout=60)
        fleet.join(timeout=30)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    turnaround, first_task, msgs_per_s = [], [], []
    for r in range(1, rounds):
        last_reply = times["reply"][r][1]
        nxt = times["task"].get(r + 1)
        if nxt is None:
            continue
        turnaround.append(nxt[1] - last_reply)
        first_task.append(nxt[0] - last_reply)
        span = times["ack"][r][1] - times["task"][r][0]  # first task out -> last ack in
        msgs_per_s.append(3 * n / span)
    return {
        "agents": n,
        "rounds": rounds,
        "wall_s": wall,
        "turnaround_ms": 1e3 * statistics.median(turnaround),
        "first_task_ms": 1e3 * statistics.median(first_task),
        "msgs_per_s": statistics.median(msgs_per_s),
        "round_s": [m["duration_s"] for m in result.metrics if m["phase"] == "train"],
        "peak_rss_mb": rss / 1024,
        "rss_before_mb": rss0 / 1024,
        "bytes_per_round": statistics.median(
            m["bytes_total"] for m in result.metrics if m["phase"] == "train"
        ),
        "rejected": result.rejected,
    }


def main(argv: list[str] | None = None) -> None:
    """Run the grid and print a markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", nargs="+", type=int, default=[10, 100, 1000])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dim", type=int, default=512, help="prototype size (ResNet-18: 512)")
    ap.add_argument("--classes", type=int, default=10)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    rows = []
    for n in args.agents:
        r = run_one(n, args.rounds, args.dim, args.classes)
        rows.append(r)
        print(f"N={n}: {r}", flush=True)
    print(
        "\n| agents | turnaround (last reply -> last next task) | first next task | "
        "msgs/s | round time (s) | MB per round | peak RSS (MB) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['agents']} | {r['turnaround_ms']:.1f} ms | {r['first_task_ms']:.1f} ms | "
            f"{r['msgs_per_s']:.0f} | {statistics.median(r['round_s']):.2f} | "
            f"{r['bytes_per_round'] / 1e6:.2f} | {r['peak_rss_mb']:.0f} |"
        )


if __name__ == "__main__":
    main()
