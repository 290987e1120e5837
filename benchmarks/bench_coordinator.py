"""Coordinator ingest against the broker's own rate, and overhead per round, with N
protocol-only agents over a real loopback Mosquitto.

The coordinator (the real engine, store and ``fedproto`` strategy) runs in this process; the
fleet runs in a child process. Fake agents register like real ones and, once every task of a
step has arrived, answer all of them in one burst with realistic FedProto replies (prototypes
of the 2-6 classes they hold, ``--dim`` float32 features each: ~8.4 KB at 512), pre-encoded and
written by a raw-socket MQTT publisher (``bench_ingest.RawMqtt``), so the fleet never limits
the coordinator. Acks are counted by a raw-socket subscriber; tasks arrive through the lean
client (``protocol.transport.lean_mqtt``; through paho, ~135 us of CPU a message, receiving 10,000
tasks
took the fleet ~6 s, which the fleet-side ``close`` then measured).

In the same run, before each burst to the coordinator (while it idles, waiting for replies),
the fleet replays the previous step's reply frames, byte for byte, on a twin federation's
topics (``bencx``: same topic lengths) that only a *raw consumer* process subscribes to, at
QoS 1 like the coordinator, acknowledging every message. That is the broker's own rate for
the same replies on the same broker, machine and load.

Figures per N (median over the steps after the first):

* ``coord replies/s``: N / (first reply written -> last ack received): decode, validation,
  the durable SQLite write, and the ack, for every reply;
* ``broker replies/s``: N / (first frame written -> last frame received by the raw consumer);
* ``ratio``: coord / broker, per step, then the median (the issue's goal: >= 0.5);
* ``turnaround``: last reply written -> last task of the next step received (ingest of the
  tail, aggregation, persistence, N task sends);
* ``first task``: last reply written -> first task of the next step received;
* ``close``: last ack received -> last task of the next step received: the coordinator's
  overhead between steps once every reply is in (aggregation, persistence, N task sends);
* ``engine close``: the same span as the coordinator's engine sees it: its last ack of a step
  handed to its MQTT client -> its last task of the next step handed to it (the fleet's
  reception of 10,000 tasks through one paho client is not in it);
* ``msgs/s``: coordinator messages of one step (N tasks out, N replies in, N acks out) per
  second of that step (its first task received -> its last ack received);
* ``registration``: first registration written -> the coordinator has them all online;
* ``peak RSS``: the coordinator process's maximum resident set (``ru_maxrss``).

With ``--ingest-workers N`` the replies go to N ``coordinator ingest-worker`` processes
(shared subscription, ``run.ingest_workers``): the coordinator rate is then the workers' (they
decode, validate, store and ack), and each worker's CPU time, stored replies and time spent
waiting for the store's write lock are reported.

Usage::

    python benchmarks/bench_coordinator.py --agents 1000 --rounds 6
    python benchmarks/bench_coordinator.py --agents 1000 --rounds 6 --ingest-workers 2
    python benchmarks/bench_coordinator.py --agents 100 --rounds 4 --weights-kb 1024 \
        --ingest-workers 0 2    # FedAvg-sized chunked replies: in-process vs with workers
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import logging
import multiprocessing as mp
import os
import queue
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ingest import RawMqtt, consumer_main  # sibling benchmark module

FEDERATION = "bench"
TWIN = "bencx"  # the raw consumer's federation: same length, so the same topic bytes


def _device_of(topic: str) -> str:
    return topic.split("/")[4]  # edgefl/v1/{fed}/dev/{device}/...


def cpu_ns(pids: dict[str, int]) -> dict[str, int]:
    """CPU time of each process so far, in ns: every thread's time on a CPU, from
    ``/proc/PID/task/TID/schedstat`` (nanoseconds; ``/proc/PID/stat`` counts 10 ms ticks)."""
    out: dict[str, int] = {}
    for name, pid in pids.items():
        total = 0
        with contextlib.suppress(OSError):  # a thread or the process ended meanwhile
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    total += int((task / "schedstat").read_text().split()[0])
        out[name] = total
    return out


def cpu_spent(before: dict[str, int], pids: dict[str, int]) -> dict[str, int]:
    """CPU ns each process spent since ``before`` (:func:`cpu_ns`)."""
    now = cpu_ns(pids)
    return {name: now[name] - before.get(name, 0) for name in now}


def fleet_main(  # noqa: PLR0915, PLR0917 - one self-contained child process
    port: int,
    n: int,
    dim: int,
    num_classes: int,
    out: Any,
    stop: Any,
    expect: Any,
    raw: Any,
    weights_kb: int = 0,
    pids: dict[str, int] | None = None,
) -> None:
    """Child process: N fake agents; reports per-step timestamps and raw-consumer bursts, and
    the CPU time each process of ``pids`` (and this one, ``fleet``) spent in each burst."""
    import msgpack
    import numpy as np

    from protocol.contract.chunking import DEFAULT_CHUNK_POLICY, split_frame
    from protocol.contract.codec import Envelope, encode
    from protocol.contract.messages import Capabilities, InputSpec, Register, Reply, Status, Task
    from protocol.contract.payloads import PrototypeSet, TensorMap
    from protocol.contract.topics import Topics
    from protocol.transport.endpoint import Endpoint
    from protocol.transport.lean_mqtt import LeanMqttTransport

    logging.basicConfig(level=logging.ERROR)
    topics, twin = Topics(FEDERATION), Topics(TWIN)
    rng = np.random.default_rng(0)
    ids = [f"dev{i:05d}" for i in range(n)]
    held = {
        d: np.sort(rng.choice(num_classes, size=int(rng.integers(2, 7)), replace=False))
        for d in ids
    }
    tasks: queue.Queue[tuple[str, Task]] = queue.Queue()
    times: dict[str, Any] = {"task": {}, "reply": {}, "ack": {}, "raw": {}, "phase": {}}
    times["cpu"] = {"raw": {}, "coordinator": {}}  # step -> {process: CPU ns in that burst}
    pids = {**(pids or {}), "fleet": os.getpid()}
    burst_cpu: dict[int, dict[str, int]] = {}  # a coordinator burst's start, until its last ack
    lock = threading.Lock()

    def stamp(kind: str, step: int, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        with lock:
            first, _last, count = times[kind].get(step, (now, now, 0))
            times[kind][step] = (first, now, count + 1)

    def step_of(task_id: str) -> int:
        return int(task_id.split(".")[-3])  # run.step.attempt.device

    def on_task(env: Any, topic: str) -> None:
        if isinstance(env.body, Task):
            stamp("task", step_of(env.body.task_id))
            tasks.put((_device_of(topic), env.body))

    def on_ack(_topic: str, payload: bytes) -> bool:
        step = step_of(msgpack.unpackb(payload)["b"]["task_id"])
        stamp("ack", step)
        if times["ack"][step][2] == n and step in burst_cpu:  # the burst's last ack
            times["cpu"]["coordinator"][step] = cpu_spent(burst_cpu.pop(step), pids)
        return not stop.is_set()

    transport = LeanMqttTransport(client_id="fakefleet", port=port, clean_session=True)
    receiver = Endpoint(transport, sender="fleet", federation=FEDERATION)
    receiver.subscribe(f"{topics.base}/dev/+/down/task", on_task)
    transport.connect()
    acks = RawMqtt(port, "fleetacks")
    acks.subscribe(f"{topics.base}/dev/+/down/ack", 1)
    threading.Thread(target=acks.consume, args=(on_ack,), daemon=True).start()
    pub = RawMqtt(port, "fleetpub")
    threading.Thread(target=pub.drain_forever, daemon=True).start()

    def frame(d: str, body: Any, round_: int = 0) -> bytes:
        return encode(Envelope(body=body, sender=d, federation=FEDERATION, round=round_))

    threshold = DEFAULT_CHUNK_POLICY.threshold

    def reply_frames(d: str, reply: Reply, round_: int) -> list[tuple[str, bytes]]:
        """The reply as its agent's endpoint sends it: whole, or as chunk frames."""
        whole, topic = frame(d, reply, round_), topics.up(d, "reply")
        if len(whole) <= threshold:
            return [(topic, whole)]
        chunks = topics.chunk_topic(topic)  # as the endpoint sends them: on the chunk topic
        return [(chunks, frame(d, c, round_)) for c in split_frame(whole, threshold - 512)]

    status = [(topics.status(d), frame(d, Status(state="online"))) for d in ids]
    regs = []
    registered: dict[str, int] = {}  # a reply may count at most its agent's registered samples
    for d in ids:
        counts = {str(int(c)): int(rng.integers(20, 200)) for c in held[d]}
        registered[d] = sum(counts.values())
        reg = Register(
            device_id=d,
            arch="resnet18",
            num_params=11_000_000,
            capabilities=Capabilities(device="cpu"),
            input_spec=InputSpec(3, 32, 32),
            num_classes=num_classes,
            class_counts=counts,
            algorithm="fedavg" if weights_kb else "fedproto",
        )
        regs.append((topics.up(d, "register"), frame(d, reg)))
    times["registration_start"] = time.perf_counter()
    pub.publish_many(status, retain=True)
    pub.publish_many(regs)

    def reply_for(d: str, task: Task) -> Reply:
        if task.phase != "train":
            return Reply(
                task_id=task.task_id,
                round=task.round,
                phase=task.phase,
                num_samples=100,
                metrics={"acc_local": 0.5},
            )
        k = held[d]
        samples = min(int(50 * len(k)), registered[d])
        if weights_kb:  # FedAvg-sized: one float32 tensor of weights_kb KiB
            w = rng.standard_normal(weights_kb * 256, dtype=np.float32)
            return Reply(
                task_id=task.task_id,
                round=task.round,
                phase=task.phase,
                num_samples=samples,
                payloads={"weights": TensorMap({"w": w})},
                metrics={"acc_local": 0.5, "train_loss": 1.0},
            )
        protos = PrototypeSet(
            class_ids=k.astype(np.int32),
            vectors=rng.standard_normal((len(k), dim), dtype=np.float32),
            counts=np.full(len(k), 50, dtype=np.int32),
        )
        return Reply(
            task_id=task.task_id,
            round=task.round,
            phase=task.phase,
            num_samples=samples,
            payloads={"protos": protos},
            metrics={"acc_local": 0.5, "acc_global": 0.4, "train_loss": 1.0},
        )

    def raw_burst(step: int, frames: list[tuple[str, bytes]]) -> None:
        """The same frames to the raw consumer, while the coordinator waits for replies."""
        expect.put(len(frames))
        time.sleep(0.05)  # let the consumer enter its receive loop
        replay = [(twin.base + t[len(topics.base) :], f) for t, f in frames]
        cpu0, t0 = cpu_ns(pids), time.perf_counter()
        pub.publish_many(replay)
        count, size, _first, last = raw.get(timeout=120)
        times["cpu"]["raw"][step] = cpu_spent(cpu0, pids)
        per_reply = len(frames) / n  # chunk frames per reply (1: whole replies)
        times["raw"][step] = (t0, last, count / per_reply, size)

    def worker() -> None:
        pending: dict[int, list[tuple[str, Task]]] = {}
        previous: list[tuple[str, bytes]] = []
        while not stop.is_set():
            try:
                d, task = tasks.get(timeout=0.2)
            except queue.Empty:
                continue
            step = step_of(task.task_id)
            pending.setdefault(step, []).append((d, task))
            if len(pending[step]) < n:
                continue
            batch = pending.pop(step)
            times["phase"][step] = batch[0][1].phase
            frames = [f for d, t in batch for f in reply_frames(d, reply_for(d, t), t.round)]
            if previous:
                raw_burst(step, previous)
            burst_cpu[step] = cpu_ns(pids)
            stamp("reply", step)
            pub.publish_many(frames)
            stamp("reply", step)
            previous = frames

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    stop.wait()
    thread.join(timeout=5)
    with lock:
        out.put({k: (dict(v) if isinstance(v, dict) else v) for k, v in times.items()})
    transport.close()
    pub.close()
    acks.close()


def worker_main(run_dir: str, port: int, worker: str, out: Any, imported: Any) -> None:
    """Child process: one ingest worker until the run finishes; reports its figures.
    ``imported`` is set once the toolkit is imported (the fleet starts after that)."""
    from coordinator.engine.ingest_worker import run_ingest_worker

    imported.set()
    logging.basicConfig(level=logging.ERROR)
    cpu0 = time.process_time()
    counts = run_ingest_worker(Path(run_dir), "127.0.0.1", port, worker, wait_s=600.0)
    out.put({"worker": worker, "cpu_s": time.process_time() - cpu0, **counts})


class _OnlineTimer(logging.Handler):
    """Notes when the engine logs that every agent it waited for is online."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.at: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.at is None and "agents online" in record.getMessage():
            self.at = time.perf_counter()


def run_one(
    n: int,
    rounds: int,
    dim: int,
    num_classes: int,
    store_dir: str | None = None,
    *,
    broadcast: bool = True,
    ingest_workers: int = 0,
    client: str = "lean",
    profile: str | None = None,
    weights_kb: int = 0,
) -> dict[str, Any]:
    """One coordinator run with ``n`` fake agents; returns the figures for that N."""
    from coordinator.broker.embedded import MosquittoBroker
    from coordinator.config import load_config
    from coordinator.engine.runner import coordinator_will, mqtt_client, run_coordinator

    ctx = mp.get_context("spawn")  # the children must not inherit our MQTT threads
    with MosquittoBroker() as broker, tempfile.TemporaryDirectory(dir=store_dir) as tmp:
        out, stop, expect, raw, ready = (
            ctx.Queue(),
            ctx.Event(),
            ctx.Queue(),
            ctx.Queue(),
            ctx.Event(),
        )
        consumer = ctx.Process(
            target=consumer_main,
            args=(broker.port, f"edgefl/v1/{TWIN}/dev/+/up/reply/#", expect, raw, ready),
        )
        consumer.start()
        ready.wait(60)
        cfg = load_config(
            None,
            [],
            algorithm="fedavg" if weights_kb else "fedproto",
            rounds=rounds,
            run_dir=str(Path(tmp) / "run"),
            min_agents=n,
            fraction=1.0,
            deadline_s=600.0,
            num_classes=num_classes,
            federation=FEDERATION,
            run_id="bench",
            wait_agents_s=600.0,
            broadcast=broadcast,  # the global prototypes once on bcast/knowledge, or per task
            ingest_workers=ingest_workers,
            mqtt_client=client,  # the workers read it from the stored config too
        )
        figures = ctx.Queue()
        imported = [ctx.Event() for _ in range(ingest_workers)]
        workers = [
            ctx.Process(
                target=worker_main,
                args=(cfg.run_dir, broker.port, f"w{i + 1}", figures, imported[i]),
            )
            for i in range(ingest_workers)
        ]
        for w in workers:
            w.start()  # they wait for the run's store
        # a fleet does not join within a second of its coordinator's start: the workers'
        # imports (~1 s of CPU each) would otherwise run on the same cores as the registrations
        for event in imported:
            event.wait(120)
        pids = {"broker": broker.pid or 0, "coordinator": os.getpid()}
        pids["consumer"] = consumer.pid or 0
        pids.update({f"w{i + 1}": w.pid or 0 for i, w in enumerate(workers)})
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        transport = mqtt_client(cfg)(
            client_id="coordinator",
            port=broker.port,
            will=coordinator_will(cfg),
            clean_session=True,
        )
        logger = logging.getLogger("edgefl.bench.coordinator")
        logger.setLevel(logging.INFO)
        logger.propagate = False
        timer = _OnlineTimer()
        logger.addHandler(timer)
        fleet = ctx.Process(
            target=fleet_main,
            args=(broker.port, n, dim, num_classes, out, stop, expect, raw, weights_kb, pids),
        )
        fleet.start()
        sends = _time_sends(transport)
        cpu0, t0 = time.process_time(), time.perf_counter()
        if profile:  # the engine's thread only; the MQTT client's network thread is not in it
            profiler = cProfile.Profile()
            result = profiler.runcall(run_coordinator, cfg, transport, logger)
            profiler.dump_stats(profile)
        else:
            result = run_coordinator(cfg, transport, logger)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        transport.close()
        stop.set()
        times = out.get(timeout=120)
        fleet.join(timeout=30)
        expect.put(0)
        consumer.join(timeout=30)
        worker_figures = [figures.get(timeout=120) for _ in workers]
        for w in workers:
            w.join(timeout=30)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out_figures = _figures(n, rounds, times, result, timer.at, wall, cpu, rss, rss0)
    out_figures["engine_close_ms"] = _engine_close_ms(sends, n)
    out_figures["ingest_workers"] = sorted(worker_figures, key=lambda f: f["worker"])
    out_figures["mqtt_client"] = client
    return out_figures


def _time_sends(transport: Any) -> list[tuple[float, str]]:
    """When the coordinator handed each task and ack to its MQTT client (the client's own
    publish, wrapped): the close as the coordinator sees it, without the fleet's reception."""
    from protocol.transport.base import Transport

    sends: list[tuple[float, str]] = []
    publish, publish_many = transport.publish, transport.publish_many

    def timed(topic: str, payload: bytes, **kwargs: Any) -> None:
        publish(topic, payload, **kwargs)
        kind = topic.rsplit("/", 1)[-1]
        if kind in ("task", "ack"):
            sends.append((time.perf_counter(), kind))

    def timed_many(messages: list[tuple[str, bytes]], **kwargs: Any) -> None:
        publish_many(messages, **kwargs)  # a step's tasks, a batch's acks: handed over at once
        now = time.perf_counter()
        for topic, _ in messages:
            kind = topic.rsplit("/", 1)[-1]
            if kind in ("task", "ack"):
                sends.append((now, kind))

    transport.publish = timed
    if type(transport).publish_many is not Transport.publish_many:  # else it calls publish
        transport.publish_many = timed_many
    return sends


def _engine_close_ms(sends: list[tuple[float, str]], n: int) -> float | None:
    """Median over the steps after the first of: the step's last ack handed to the client ->
    the next step's last task handed to it (a burst of ``n`` tasks with no ack between)."""
    closes: list[float] = []
    last_ack: float | None = None  # before the current burst
    last_task, count = 0.0, 0  # the current burst of tasks
    for at, kind in [*sends, (float("inf"), "ack")]:
        if kind == "task":
            last_task, count = at, count + 1
            continue
        if count == n and last_ack is not None:
            closes.append(last_task - last_ack)
        last_ack, count = at, 0
    return 1e3 * statistics.median(closes) if closes else None


def _figures(  # noqa: PLR0917 - a flat record of one run
    n: int,
    rounds: int,
    times: dict[str, Any],
    result: Any,
    online_at: float | None,
    wall: float,
    cpu_s: float,
    rss: int,
    rss0: int,
) -> dict[str, Any]:
    steps = sorted(times["reply"])
    turnaround, first_task, msgs_per_s, coord, broker, ratio, reply_bytes, close = (
        [] for _ in range(8)
    )
    cpu: dict[str, list[tuple[dict[str, int], float]]] = {"raw": [], "coordinator": []}
    for s in steps[1:]:  # the first step pays for warm-up (and has no raw burst before it)
        sent, written = times["reply"][s][0], times["reply"][s][1]
        ack = times["ack"].get(s)
        raw = times["raw"].get(s)
        if ack is None or raw is None or ack[2] < n:
            continue
        if times["phase"][s] != "train" or times["phase"].get(s - 1) != "train":
            continue  # the raw replay is the previous step's frames: compare like with like
        coord.append(n / (ack[1] - sent))
        t0, last, count, size = raw
        broker.append(count / (last - t0))
        reply_bytes.append(size / count)
        ratio.append(coord[-1] / broker[-1])
        for phase, replies in (("raw", count), ("coordinator", n)):
            if s in times["cpu"][phase]:
                cpu[phase].append((times["cpu"][phase][s], replies))
        msgs_per_s.append(3 * n / (ack[1] - times["task"][s][0]))
        nxt = times["task"].get(s + 1)
        if nxt is not None:
            turnaround.append(nxt[1] - written)
            first_task.append(nxt[0] - written)
            close.append(nxt[1] - ack[1])
    med = statistics.median
    registration = None if online_at is None else online_at - times["registration_start"]
    return {
        "agents": n,
        "rounds": rounds,
        "wall_s": wall,
        "coordinator_cpu_s": cpu_s,
        "registration_s": registration,
        "reply_bytes": med(reply_bytes) if reply_bytes else None,
        "coord_replies_per_s": med(coord) if coord else None,
        "broker_replies_per_s": med(broker) if broker else None,
        "ratio": med(ratio) if ratio else None,
        "ratios": [round(r, 3) for r in ratio],
        "turnaround_ms": 1e3 * med(turnaround) if turnaround else None,
        "first_task_ms": 1e3 * med(first_task) if first_task else None,
        "close_ms": 1e3 * med(close) if close else None,
        "msgs_per_s": med(msgs_per_s) if msgs_per_s else None,
        "round_s": [m["duration_s"] for m in result.metrics if m["phase"] == "train"],
        "peak_rss_mb": rss / 1024,
        "rss_before_mb": rss0 / 1024,
        "bytes_per_round": med(m["bytes_total"] for m in result.metrics if m["phase"] == "train"),
        "rejected": result.rejected,
        **_cpu_figures(cpu),
    }


def _cpu_figures(cpu: dict[str, list[tuple[dict[str, int], float]]]) -> dict[str, Any]:
    """CPU time per reply of each process in the raw replay and in the coordinator's burst
    (microseconds, over the compared steps), and what they bound on a machine where no process
    waits for a core: each process moves at most 1e6 / (its us per reply) replies a second,
    and the slowest one sets the pace. The ratio of the two bounds is what the measured ratio
    would approach with a core per process; a bound, not a measurement: a Python process also
    runs a second thread beside the GIL-holding one, and on a loaded machine CPU time per
    reply inflates with cache and frequency sharing."""
    per_reply: dict[str, dict[str, float]] = {}
    for phase, samples in cpu.items():
        replies = sum(r for _, r in samples)
        if not samples or not replies:
            continue
        names = set().union(*(spent for spent, _ in samples))
        per_reply[phase] = {
            name: round(sum(spent.get(name, 0) for spent, _ in samples) / replies / 1e3, 1)
            for name in sorted(names)
        }
    out: dict[str, Any] = {"cpu_us_per_reply": per_reply}
    raw, coord = per_reply.get("raw"), per_reply.get("coordinator")
    if raw and coord:
        # the coordinator idles through the replay, the raw consumer through the burst
        raw_path = {k: v for k, v in raw.items() if k in ("broker", "consumer", "fleet")}
        coord_path = {k: v for k, v in coord.items() if k != "consumer"}
        raw_bound = max(raw_path, key=lambda k: raw_path[k])
        coord_bound = max(coord_path, key=lambda k: coord_path[k])
        out["core_per_process_bound"] = {
            "raw_replies_per_s": round(1e6 / raw_path[raw_bound]),
            "raw_limited_by": raw_bound,
            "coord_replies_per_s": round(1e6 / coord_path[coord_bound]),
            "coord_limited_by": coord_bound,
            "ratio": round(raw_path[raw_bound] / coord_path[coord_bound], 3),
        }
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> None:
    """Run the grid and print a markdown table (with the machine's load before each N)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", nargs="+", type=int, default=[1000])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--dim", type=int, default=512, help="prototype size (ResNet-18: 512)")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument(
        "--store-dir",
        default=None,
        help="where the coordinator's run directory (SQLite store) lives (default: the temp "
        "dir; /dev/shm separates the disk's fsync cost from the CPU's)",
    )
    ap.add_argument(
        "--broadcast",
        choices=("on", "off"),
        default="on",
        help="run.broadcast: the step's shared knowledge once on bcast/knowledge (on) or in "
        "every task (off)",
    )
    ap.add_argument(
        "--ingest-workers",
        type=int,
        nargs="+",
        default=[0],
        help="run.ingest_workers: 0 = the coordinator takes the replies; N = N ingest-worker "
        "processes do (several values: one run each, in turn)",
    )
    ap.add_argument(
        "--mqtt-client",
        nargs="+",
        choices=("lean", "paho"),
        default=["lean"],
        help="run.mqtt_client of the coordinator and its workers (several: one run each, in "
        "turn, per N and worker count)",
    )
    ap.add_argument(
        "--weights-kb",
        type=int,
        default=0,
        help="FedAvg-sized replies: K KiB of float32 weights each (algorithm fedavg; a reply "
        "over the 256 KiB chunk threshold goes as chunk frames, as an agent sends it; with "
        "ingest workers the leader takes the chunks, on their own topic). 0: FedProto prototypes",
    )
    ap.add_argument(
        "--profile",
        metavar="FILE",
        default=None,
        help="cProfile the coordinator's engine thread into FILE (pstats; one run: the last "
        "of the grid's runs overwrites it). Profiling slows the engine: its timings are not "
        "the table's",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    rows = []
    grid = [(n, w, c) for n in args.agents for w in args.ingest_workers for c in args.mqtt_client]
    for n, workers, client in grid:
        load = os.getloadavg()
        r = run_one(
            n,
            args.rounds,
            args.dim,
            args.classes,
            args.store_dir,
            broadcast=args.broadcast == "on",
            ingest_workers=workers,
            client=client,
            profile=args.profile,
            weights_kb=args.weights_kb,
        )
        r["load_before"] = [round(x, 2) for x in load]
        r["load_after"] = [round(x, 2) for x in os.getloadavg()]
        rows.append(r)
        print(f"N={n}: {r}", flush=True)
    print(
        "\n| agents | client | workers | reply B | coord replies/s | broker replies/s | ratio | "
        "turnaround | first next task | close | engine close | msgs/s | registration | "
        "peak RSS (MB) | load 1-min before/after |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['agents']} | {r['mqtt_client']} | {len(r['ingest_workers'])} | "
            f"{_fmt(r['reply_bytes'], '.0f')} | "
            f"{_fmt(r['coord_replies_per_s'], ',.0f')} | "
            f"{_fmt(r['broker_replies_per_s'], ',.0f')} | "
            f"{_fmt(r['ratio'], '.3f')} | {_fmt(r['turnaround_ms'], '.0f')} ms | "
            f"{_fmt(r['first_task_ms'], '.0f')} ms | {_fmt(r['close_ms'], '.0f')} ms | "
            f"{_fmt(r['engine_close_ms'], '.0f')} ms | {_fmt(r['msgs_per_s'], ',.0f')} | "
            f"{_fmt(r['registration_s'], '.2f')} s | {r['peak_rss_mb']:.0f} | "
            f"{r['load_before'][0]} / {r['load_after'][0]} |"
        )


if __name__ == "__main__":
    main()
