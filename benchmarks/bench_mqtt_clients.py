"""Per-message CPU of the MQTT clients: paho-mqtt, the lean client, and a raw socket probe.

Why the coordinator has a client of its own (``protocol/transport/lean_mqtt.py``): it receives a
reply and
sends an ack and a task per device and round. This measures, on one Mosquitto:

* **receive**: a raw publisher writes ``--messages`` QoS 1 frames of ``--size`` bytes in one
  burst; the client under test receives them (QoS 1, acknowledging each). Figures: the
  receiving thread's CPU per message, and messages/s from the first write to the last receipt.
* **publish**: the client publishes ``--messages`` QoS 1 messages of 500 bytes (an ack or a
  small task) from the calling thread; a raw subscriber counts them. Figures: the process's
  CPU per message (caller and network thread), and messages/s until the last one arrived.

The raw probe (``bench_ingest.RawMqtt``) is the floor: a socket, no callbacks, no threads.

Usage::

    python benchmarks/bench_mqtt_clients.py --messages 2000 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ingest import RawMqtt  # sibling benchmark module

CLIENTS = ("paho", "lean", "raw")


def _thread_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_THREAD)
    return use.ru_utime + use.ru_stime


def _client(kind: str, port: int, name: str) -> Any:
    from protocol.transport.lean_mqtt import LeanMqttTransport
    from protocol.transport.paho import MqttTransport

    cls = MqttTransport if kind == "paho" else LeanMqttTransport
    return cls(client_id=name, port=port, clean_session=True)


def receive(kind: str, port: int, n: int, size: int) -> tuple[float, float]:
    """(CPU us per message on the receiving thread, messages/s) for a burst of ``n``."""
    payload, done = os.urandom(size), threading.Event()
    state = {"n": 0, "cpu0": 0.0, "cpu1": 0.0}

    def take(_topic: str, _payload: bytes) -> bool:
        if not state["n"]:
            state["cpu0"] = _thread_cpu()
        state["n"] += 1
        if state["n"] == n:
            state["cpu1"] = _thread_cpu()
            done.set()
        return state["n"] < n

    publisher = RawMqtt(port, f"pub-{kind}")
    threading.Thread(target=publisher.drain_forever, daemon=True).start()
    frames = [(f"bench/dev/{i}/up/reply", payload) for i in range(n)]
    if kind == "raw":
        consumer = RawMqtt(port, "raw-consumer")
        consumer.subscribe("bench/dev/+/up/reply", 1)
        t0 = time.perf_counter()
        threading.Thread(target=publisher.publish_many, args=(frames,), daemon=True).start()
        consumer.consume(take)
        consumer.close()
    else:
        client = _client(kind, port, f"{kind}-consumer")
        client.subscribe("bench/dev/+/up/reply", take)
        client.connect()
        t0 = time.perf_counter()
        publisher.publish_many(frames)
        if not done.wait(120):
            raise RuntimeError(f"{kind}: {state['n']} of {n} messages arrived in 120 s")
        client.close()
    wall = time.perf_counter() - t0
    publisher.close()
    return 1e6 * (state["cpu1"] - state["cpu0"]) / n, n / wall


def publish(kind: str, port: int, n: int) -> tuple[float, float]:
    """(process CPU us per message, messages/s) for ``n`` QoS 1 publishes of 500 bytes."""
    payload = os.urandom(500)
    counter = RawMqtt(port, f"count-{kind}")
    counter.subscribe("bench/dev/+/down/task", 1)
    got = threading.Event()
    threading.Thread(target=counter.consume, args=(_counting(n, got),), daemon=True).start()
    items = [(f"bench/dev/{i}/down/task", payload) for i in range(n)]
    if kind == "raw":
        sender = RawMqtt(port, "raw-sender")
        threading.Thread(target=sender.drain_forever, daemon=True).start()
        cpu0, t0 = time.process_time(), time.perf_counter()
        sender.publish_many(items)
    else:
        sender = _client(kind, port, f"{kind}-sender")
        sender.connect()
        cpu0, t0 = time.process_time(), time.perf_counter()
        for topic, body in items:
            sender.publish(topic, body)
    if not got.wait(120):
        raise RuntimeError(f"{kind}: not every publish arrived in 120 s")
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    sender.close()
    counter.close()
    return 1e6 * cpu / n, n / wall


def _counting(n: int, got: threading.Event) -> Any:
    seen = [0]

    def take(_topic: str, _payload: bytes) -> bool:
        seen[0] += 1
        if seen[0] == n:
            got.set()
        return seen[0] < n

    return take


def main(argv: list[str] | None = None) -> None:
    """Alternate the clients ``--repeat`` times and print medians as a markdown table."""
    from coordinator.broker.embedded import MosquittoBroker

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--size", type=int, default=8450, help="received frame size (a reply)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    rows: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with MosquittoBroker() as broker:
        for _ in range(args.repeat):
            for kind in CLIENTS:
                rows.setdefault(("receive", kind), []).append(
                    receive(kind, broker.port, args.messages, args.size)
                )
                rows.setdefault(("publish", kind), []).append(
                    publish(kind, broker.port, args.messages)
                )
    print(f"\n{args.messages} messages, load {os.getloadavg()[0]:.2f}; medians of {args.repeat}")
    print("| direction | client | CPU us / message | messages/s |\n|---|---|---|---|")
    for (direction, kind), runs in rows.items():
        cpu = statistics.median(r[0] for r in runs)
        rate = statistics.median(r[1] for r in runs)
        print(f"| {direction} | {kind} | {cpu:.1f} | {rate:,.0f} |")


if __name__ == "__main__":
    main()
