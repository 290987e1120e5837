"""The broker's own rate for reply frames, and reply decoding cost, typed path against lean path.

Two parts:

* :class:`RawMqtt`, a minimal MQTT 3.1.1 client over a plain socket (CONNECT, SUBSCRIBE,
  PUBLISH at QoS 0/1, PUBACK), used by ``bench_coordinator.py`` as the *raw consumer*: it
  subscribes at QoS 1 like the coordinator, acknowledges every PUBLISH (one write per socket
  read) and hands each payload out as ``bytes`` like paho, and does nothing else. Its rate is
  the ceiling a coordinator could reach on this broker and machine; it is also the fleet's raw
  publisher (pre-encoded frames in one ``sendall``), so the publisher never limits the broker.
* ``main``: in-process decode throughput of FedProto-sized reply frames through the typed walk
  (``protocol.contract.codec.decode``, forced) and the lean path (``protocol.contract.lean``), and,
  with
  ``--broker``, the raw-publisher -> Mosquitto -> raw-consumer rate for the same frames.

Usage::

    python benchmarks/bench_ingest.py --replies 5000 --dim 512 --broker
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from protocol.transport.mqtt_packets import (
    CONNACK,
    PUBLISH,
    SUBACK,
    connect_packet,
    parse_packet,
    publish_packet,
    subscribe_packet,
)


class RawMqtt:
    """A minimal blocking MQTT 3.1.1 client: just what a fair broker measurement needs."""

    def __init__(self, port: int, client_id: str, host: str = "127.0.0.1") -> None:
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self._buf = bytearray()
        self.sock.sendall(connect_packet(client_id, keepalive=60, clean_session=True))
        kind, _flags, data = self._read_packet()
        if kind != CONNACK or data[1] != 0:
            raise ConnectionError(f"CONNACK expected, got type {kind} {bytes(data)!r}")
        self._pid = 0

    def next_pid(self) -> int:
        """The next packet id (1..65535)."""
        self._pid = self._pid % 65535 + 1
        return self._pid

    def subscribe(self, topic_filter: str, qos: int = 1) -> None:
        """SUBSCRIBE and wait for the SUBACK."""
        self.sock.sendall(subscribe_packet(self.next_pid(), [(topic_filter, qos)]))
        kind, _flags, data = self._read_packet()
        if kind != SUBACK or data[-1] == 0x80:
            raise ConnectionError(f"SUBACK expected, got type {kind} {bytes(data)!r}")

    def publish_many(
        self, items: Iterable[tuple[str, bytes]], qos: int = 1, retain: bool = False
    ) -> int:
        """Send every (topic, payload) in one write; PUBACKs go to :meth:`drain_forever`."""
        packets = b"".join(
            publish_packet(t, p, qos, self.next_pid(), retain=retain) for t, p in items
        )
        self.sock.sendall(packets)
        return len(packets)

    def drain_forever(self) -> None:
        """Read and discard whatever the broker sends (PUBACKs of a publisher), until closed."""
        try:
            while self.sock.recv(1 << 20):
                pass
        except OSError:
            return

    def _read_packet(self) -> tuple[int, int, memoryview]:
        while True:
            found = parse_packet(self._buf)
            if found is not None:
                kind, flags, start, end = found
                data = memoryview(bytes(self._buf[start:end]))
                del self._buf[:end]
                return kind, flags, data
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("broker closed the connection")
            self._buf += chunk

    def consume(self, on_payload: Callable[[str, bytes], bool]) -> None:
        """Receive PUBLISH packets, acknowledge QoS 1 ones (one write per read) and hand each
        payload to ``on_payload`` until it returns ``False``."""
        buf = self._buf
        sock = self.sock
        while True:
            chunk = sock.recv(1 << 20)
            if not chunk:
                return
            buf += chunk
            acks = bytearray()
            pos, go_on = 0, True
            while True:
                found = parse_packet(buf, pos)
                if found is None:
                    break
                kind, flags, start, end = found
                pos = end
                if kind != PUBLISH:
                    continue
                tlen = (buf[start] << 8) | buf[start + 1]
                topic = buf[start + 2 : start + 2 + tlen].decode()
                at = start + 2 + tlen
                if flags & 0x06:
                    acks += b"\x40\x02" + buf[at : at + 2]
                    at += 2
                go_on = on_payload(topic, bytes(buf[at:end])) and go_on
            del buf[:pos]
            if acks:
                sock.sendall(acks)
            if not go_on:
                return

    def close(self) -> None:
        """DISCONNECT and close the socket."""
        with contextlib.suppress(OSError):
            self.sock.sendall(b"\xe0\x00")
        self.sock.close()


# ----- the raw consumer process used by bench_coordinator --------------------------------------


def consumer_main(port: int, topic_filter: str, expect: Any, out: Any, ready: Any) -> None:
    """Child process: subscribe at QoS 1, then per burst receive ``n`` messages and report
    (n, bytes, first receipt, last receipt). ``expect`` yields each burst's size (0 ends)."""
    client = RawMqtt(port, "rawconsumer")
    client.subscribe(topic_filter, 1)
    ready.set()
    while True:
        n = expect.get()
        if not n:
            break
        state = {"count": 0, "bytes": 0, "first": 0.0, "last": 0.0}

        def on_payload(
            _topic: str, payload: bytes, state: dict[str, Any] = state, n: int = n
        ) -> bool:
            now = time.perf_counter()
            if not state["count"]:
                state["first"] = now
            state["count"] += 1
            state["bytes"] += len(payload)
            state["last"] = now
            return bool(state["count"] < n)

        client.consume(on_payload)
        out.put((state["count"], state["bytes"], state["first"], state["last"]))
    client.close()


# ----- standalone: decode cost and broker rate ------------------------------------------------


def make_frames(n: int, dim: int, num_classes: int = 10, federation: str = "bench") -> list[Any]:
    """``n`` FedProto-sized reply frames (2-6 classes of ``dim`` floats) with their topics."""
    import numpy as np

    from protocol.contract.codec import Envelope, encode
    from protocol.contract.messages import Reply
    from protocol.contract.payloads import PrototypeSet
    from protocol.contract.topics import Topics

    rng = np.random.default_rng(0)
    topics = Topics(federation)
    out = []
    for i in range(n):
        d = f"dev{i:05d}"
        k = np.sort(rng.choice(num_classes, size=int(rng.integers(2, 7)), replace=False))
        protos = PrototypeSet(
            class_ids=k.astype(np.int32),
            vectors=rng.standard_normal((len(k), dim), dtype=np.float32),
            counts=np.full(len(k), 50, dtype=np.int32),
        )
        body = Reply(
            task_id=f"bench.0.0.{d}",
            round=1,
            phase="train",
            num_samples=int(50 * len(k)),
            payloads={"protos": protos},
            metrics={"acc_local": 0.5, "acc_global": 0.4, "train_loss": 1.0},
        )
        out.append(
            (topics.up(d, "reply"), encode(Envelope(body=body, sender=d, federation=federation)))
        )
    return out


def decode_rates(frames: list[bytes], repeat: int = 3) -> dict[str, float]:
    """Frames per second through the typed walk and through the lean path."""
    from protocol.contract import codec

    def typed(data: bytes) -> Any:
        return codec.envelope_from_map(codec.decode_frame_map(data), fast=False)

    rates: dict[str, float] = {}
    for name, fn in (
        ("typed", typed),
        ("lean", codec.decode),
        ("msgpack only", codec.decode_frame_map),
    ):
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            for f in frames:
                fn(f)
            best = min(best, time.perf_counter() - t0)
        rates[name] = len(frames) / best
    return rates


def broker_rate(frames: list[tuple[str, bytes]], repeat: int = 3) -> list[float]:
    """Replies/s raw publisher -> Mosquitto -> raw consumer (QoS 1), one figure per repeat."""
    import multiprocessing as mp

    from coordinator.broker.embedded import MosquittoBroker

    ctx = mp.get_context("spawn")
    rates = []
    with MosquittoBroker() as broker:
        expect, out, ready = ctx.Queue(), ctx.Queue(), ctx.Event()
        proc = ctx.Process(
            target=consumer_main,
            args=(broker.port, "edgefl/v1/bench/dev/+/up/reply", expect, out, ready),
        )
        proc.start()
        ready.wait(30)
        pub = RawMqtt(broker.port, "rawpublisher")
        threading.Thread(target=pub.drain_forever, daemon=True).start()
        for _ in range(repeat):
            expect.put(len(frames))
            time.sleep(0.2)
            t0 = time.perf_counter()
            pub.publish_many(frames)
            count, _size, _first, last = out.get(timeout=120)
            rates.append(count / (last - t0))
        expect.put(0)
        proc.join(10)
        pub.close()
    return rates


def main(argv: list[str] | None = None) -> None:
    """Print decode rates (typed vs lean) and, with ``--broker``, the broker's raw rate."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replies", type=int, default=5000)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--broker", action="store_true", help="also measure Mosquitto's raw rate")
    args = ap.parse_args(argv)
    frames = make_frames(args.replies, args.dim)
    size = statistics.mean(len(f) for _, f in frames)
    print(f"{len(frames)} reply frames, mean {size:.0f} bytes")
    for name, rate in decode_rates([f for _, f in frames]).items():
        print(f"decode {name}: {rate:,.0f} frames/s ({1e6 / rate:.1f} us each)")
    if args.broker:
        rates = broker_rate(frames)
        med = statistics.median(rates)
        print(f"broker raw: {med:,.0f} replies/s ({med * size / 1e6:.1f} MB/s), runs {rates}")


if __name__ == "__main__":
    main()
