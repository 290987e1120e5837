"""Protocol benchmarks: codec throughput, bytes on the wire, MQTT latency and throughput.

A plain script (not a test) that prints markdown tables::

    python benchmarks/bench_protocol.py            # everything, a few minutes on 2 cores
    python benchmarks/bench_protocol.py --quick    # fewer repetitions
    python benchmarks/bench_protocol.py --no-broker
    python benchmarks/bench_protocol.py --sections lowrank   # one section

Codec figures time ``encode``/``decode`` of a ``reply`` carrying one float32 tensor. Wire
overhead compares the frame with the raw array bytes, next to pickle and ``np.save`` of the
same array (pickle only as a local size reference; the protocol never unpickles). MQTT
figures use a mosquitto the script starts on a free loopback port (and the embedded amqtt
broker for comparison): QoS 1 ping-pong round trips, one-way message rates and the time to
move a 5 MB payload through two Endpoints (chunked). Medians over repetitions; the machine
is shared, so treat small differences as noise.
"""

from __future__ import annotations

import argparse
import io
import pickle
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from coordinator.broker.embedded import EmbeddedBroker, MosquittoBroker, mosquitto_executable
from protocol.contract.arrays import Encoding
from protocol.contract.codec import Envelope, decode, encode
from protocol.contract.lowrank import compress, is_compressed, restore
from protocol.contract.messages import Ack, Reply
from protocol.contract.payloads import TensorMap
from protocol.contract.topics import Topics
from protocol.transport.endpoint import Endpoint
from protocol.transport.paho import MqttTransport

SIZES = {"1 KB": 1_000, "100 KB": 100_000, "8 MB": 8_000_000}
T = Topics("bench")


def _reply(n_bytes: int, encoding: Encoding = "raw") -> Reply:
    w = np.random.default_rng(0).standard_normal(n_bytes // 4).astype(np.float32)
    return Reply(
        task_id="t",
        round=1,
        phase="train",
        num_samples=1,
        payloads={"w": TensorMap({"w": w}, encoding=encoding)},
    )


def _median_time(
    fn: Callable[[], Any],
    repeat: int,
    min_time: float = 0.2,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median seconds per call: each sample loops until ``min_time`` for small payloads.
    ``clock=time.process_time`` counts this process's CPU, which other load does not move."""
    fn()  # warm up (allocator, caches)
    samples = []
    for _ in range(repeat):
        n, start = 0, clock()
        while True:
            fn()
            n += 1
            elapsed = clock() - start
            if elapsed >= min_time or n >= 10_000:
                break
        samples.append(elapsed / n)
    return statistics.median(samples)


def _fmt_rate(n_bytes: int, seconds: float) -> str:
    rate = n_bytes / seconds
    return f"{rate / 1e9:.2f} GB/s" if rate >= 1e9 else f"{rate / 1e6:.0f} MB/s"


def _fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    return f"{seconds * 1e3:.2f} ms"


def bench_codec(repeat: int) -> None:
    print("\n### Codec throughput (`reply` with one float32 tensor)\n")
    print("| payload | frame bytes | encode | encode rate | decode | decode rate |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, size in SIZES.items():
        env = Envelope(body=_reply(size), sender="dev-1", federation="bench")
        frame = encode(env)
        t_enc = _median_time(partial(encode, env), repeat)
        t_dec = _median_time(partial(decode, frame), repeat)
        print(
            f"| {label} | {len(frame):,} | {_fmt_time(t_enc)} | {_fmt_rate(size, t_enc)} "
            f"| {_fmt_time(t_dec)} | {_fmt_rate(size, t_dec)} |"
        )


def bench_overhead() -> None:
    print("\n### Bytes on the wire vs raw array bytes\n")
    print(
        "| array (float32) | raw bytes | edgefl frame | overhead | overhead % "
        "| f16 frame | i8 frame | pickle | np.save |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, size in {"16 floats": 64, "1 KB": 1_000, "64 KB": 65_536, **SIZES}.items():
        body = _reply(size)
        arr = body.payloads["w"].tensors["w"]  # type: ignore[union-attr]
        frame = len(encode(Envelope(body=body, sender="dev-1", federation="bench")))
        lossy = {
            e: len(encode(Envelope(body=_reply(size, e), sender="dev-1", federation="bench")))
            for e in ("f16", "i8")
        }
        buf = io.BytesIO()
        np.save(buf, arr)
        over = frame - arr.nbytes
        pct = 100 * over / arr.nbytes
        print(
            f"| {label} | {arr.nbytes:,} | {frame:,} | {over} B | {pct:.3f} % "
            f"| {lossy['f16']:,} | {lossy['i8']:,} | {len(pickle.dumps(arr, protocol=5)):,} "
            f"| {len(buf.getvalue()):,} |"
        )
    body = _reply(65_536)
    frame = len(encode(Envelope(body=body, sender="dev-1", federation="bench")))
    body_bytes = len(msgpack.packb(body.to_wire(), use_bin_type=True))
    array_map = body.payloads["w"].to_wire()["tensors"]["w"]  # type: ignore[union-attr]
    array_bytes = len(msgpack.packb(array_map, use_bin_type=True))
    print(
        f"\nWhere the {frame - 65_536} bytes of a 64 KB `reply` go: envelope "
        f"{frame - body_bytes} B (v, k, f, s, i, r, t), `reply` and `tensors` field names and "
        f"values {body_bytes - array_bytes} B, array map (dt, sh, bin header) "
        f"{array_bytes - 65_536} B."
    )
    empty = Envelope(body=Ack(ref_id="0123456789abcdef"), sender="dev-1", federation="bench")
    print(f"A whole `ack` frame (no array) is {len(encode(empty))} bytes.")


class _NoDelayOff(MqttTransport):
    """Benchmark-only: leaves Nagle's algorithm on, to show what TCP_NODELAY buys."""

    def _on_socket_open(self, client: Any, userdata: Any, sock: Any) -> None:
        return None


@contextmanager
def _pair(port: int, cls: type[MqttTransport] = MqttTransport) -> Iterator[tuple[Any, Any]]:
    a = cls(client_id=f"bench-a-{time.monotonic_ns()}", port=port, clean_session=True)
    b = cls(client_id=f"bench-b-{time.monotonic_ns()}", port=port, clean_session=True)
    a.connect()
    b.connect()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _ping_pong(port: int, n: int, cls: type[MqttTransport] = MqttTransport) -> list[float]:
    """QoS 1 request/response round trips of 1 KB between two clients."""
    payload, got = bytes(1000), threading.Event()
    with _pair(port, cls) as (a, b):
        b.subscribe("bench/ping", lambda t, p: b.publish("bench/pong", p, qos=1))
        a.subscribe("bench/pong", lambda t, p: got.set())
        rtts = []
        for _ in range(n):
            got.clear()
            start = time.perf_counter()
            a.publish("bench/ping", payload, qos=1)
            if not got.wait(5):
                raise RuntimeError("ping-pong timed out")
            rtts.append(time.perf_counter() - start)
    return rtts


def _rate(port: int, n: int, qos: int) -> float:
    """One-way messages/s of 1 KB from one client to another."""
    payload, count, done = bytes(1000), [0], threading.Event()

    def on_msg(topic: str, data: bytes) -> None:
        count[0] += 1
        if count[0] == n:
            done.set()

    with _pair(port) as (a, b):
        b.subscribe("bench/rate", on_msg, qos=qos)
        start = time.perf_counter()
        for _ in range(n):
            a.publish("bench/rate", payload, qos=qos)
        if not done.wait(120):
            raise RuntimeError(f"only {count[0]} of {n} messages arrived")
        return n / (time.perf_counter() - start)


def _move(port: int, n_bytes: int, repeat: int) -> tuple[float, int]:
    """Seconds from Endpoint.send to delivery of an n-byte reply; and chunk frames used."""
    agent_t = MqttTransport(client_id="dev1", port=port, clean_session=True)
    coord_t = MqttTransport(client_id="coord", port=port, clean_session=True)
    agent_t.connect()
    coord_t.connect()
    agent = Endpoint(agent_t, sender="dev1", federation="bench")
    coord = Endpoint(coord_t, sender="coord", federation="bench")
    got = threading.Event()
    coord.subscribe(f"{T.base}/dev/+/up/#", lambda e, t: got.set())
    body, times = _reply(n_bytes), []
    try:
        for _ in range(repeat + 1):
            got.clear()
            start = time.perf_counter()
            agent.send(T.up("dev1", "reply"), body)
            if not got.wait(120):
                raise RuntimeError("payload did not arrive")
            times.append(time.perf_counter() - start)
    finally:
        agent_t.close()
        coord_t.close()
    chunks = agent.traffic.chunks[("tx", "reply")] // (repeat + 1)
    return statistics.median(times[1:]), chunks


def bench_broker(name: str, port: int, args: argparse.Namespace, nagle: bool) -> None:
    rtts = _ping_pong(port, args.pings)
    row = [
        f"{name}",
        _fmt_time(statistics.median(rtts)),
        _fmt_time(sorted(rtts)[int(0.9 * len(rtts))]),
    ]
    row.append(_fmt_time(statistics.median(_ping_pong(port, 20, _NoDelayOff))) if nagle else "-")
    row += [f"{_rate(port, args.messages, 1):,.0f}", f"{_rate(port, args.messages, 0):,.0f}"]
    seconds, chunks = _move(port, 5_000_000, args.repeat)
    row += [_fmt_time(seconds), str(chunks)]
    print("| " + " | ".join(row) + " |")


# FedKD's mentee layers: htfl_cnn's first model (hcnn1, the mentee under `htfllib`), cnn4's
# hidden layer, a convolution as [out, in * kh * kw]
LOWRANK_SHAPES = ((512, 4608), (512, 1024), (64, 800))


def _decaying(m: int, n: int, seed: int = 0) -> npt.NDArray[np.float32]:
    """An ``m x n`` matrix with singular values ``1 / sqrt(i + 1)``, a slowly decaying
    spectrum (a trained layer's can be flatter: the reference tier's 512 x 4608 mentee layer
    needs rank 462 for 95 %, where this one needs 364)."""
    rng = np.random.default_rng(seed)
    k = min(m, n)
    u, _ = np.linalg.qr(rng.standard_normal((m, k)))
    v, _ = np.linalg.qr(rng.standard_normal((n, k)))
    out: npt.NDArray[np.float32] = ((u / np.sqrt(np.arange(1, k + 1))) @ v.T).astype(np.float32)
    return out


def bench_lowrank(repeat: int) -> None:
    from threadpoolctl import threadpool_limits

    print("\n### Low-rank compression (FedKD's mentee on the wire), one BLAS thread, CPU time\n")
    print("| layer | energy | rank kept | factors / raw bytes | compress | restore |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    with threadpool_limits(limits=1, user_api="blas"):
        for m, n in LOWRANK_SHAPES:
            tm = TensorMap({"w": _decaying(m, n)})
            for energy in (0.95, 0.98):
                packed = compress(tm, energy)
                rank = packed.tensors["w#s"].size if is_compressed(packed) else min(m, n)
                cpu = time.process_time
                t_c = _median_time(partial(compress, tm, energy), repeat, clock=cpu)
                t_r = _median_time(partial(restore, packed), repeat, clock=cpu)
                print(
                    f"| {m} x {n} | {energy} | {rank} | {packed.num_bytes / tm.num_bytes:.2f} "
                    f"| {_fmt_time(t_c)} | {_fmt_time(t_r)} |"
                )


SECTIONS = ("codec", "overhead", "lowrank", "mqtt")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks and print markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--no-broker", action="store_true", help="codec and sizes only")
    parser.add_argument("--no-embedded", action="store_true", help="skip the amqtt broker")
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="which to run"
    )
    args = parser.parse_args(argv)
    args.repeat = 3 if args.quick else 7
    args.pings = 100 if args.quick else 500
    args.messages = 2_000 if args.quick else 10_000
    print(
        f"Python {sys.version.split()[0]}, numpy {np.__version__}; "
        f"{time.strftime('%Y-%m-%d %H:%M')}"
    )
    if "codec" in args.sections:
        bench_codec(args.repeat)
    if "overhead" in args.sections:
        bench_overhead()
    if "lowrank" in args.sections:
        bench_lowrank(args.repeat)
    if args.no_broker or "mqtt" not in args.sections:
        return 0
    print("\n### MQTT (loopback): QoS 1 round trip, messages/s (1 KB), 5 MB through Endpoints\n")
    print(
        "| broker | QoS 1 RTT median | RTT p90 | RTT without TCP_NODELAY | QoS 1 msg/s "
        "| QoS 0 msg/s | 5 MB send->deliver | chunks |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    if mosquitto_executable() is None:
        print("| mosquitto | not installed | | | | | | |")
    else:
        with MosquittoBroker() as broker:
            bench_broker("mosquitto 2.0", broker.port, args, nagle=True)
    if not args.no_embedded:
        with EmbeddedBroker() as embedded:
            args.messages //= 5  # a pure-Python broker: keep the run short
            bench_broker("embedded amqtt", embedded.port, args, nagle=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
