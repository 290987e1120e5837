"""The Prometheus exporter's cost (``coordinator serve --metrics-port``): a scrape's size and
time for a small fleet and for 10,000 agents (one last-seen series each), and what each event
the engine reports costs its thread.

Run: ``PYTHONPATH=. python benchmarks/bench_prometheus.py``
"""

from __future__ import annotations

import functools
import timeit
from collections.abc import Callable

from prometheus_client import generate_latest

from coordinator.engine.observer import LiveRun
from coordinator.strategies import Step
from coordinator.tracking.prometheus import PrometheusExporter

RECORD = {
    "round": 1,
    "phase": "train",
    "duration_s": 1.0,
    "mean_acc_local": 0.5,
    "mean_acc_global": 0.4,
    "agents": {},
    "bytes": {"rx.reply": 1, "tx.task": 1, "tx.ack": 1, "tx.round": 1},
    "bytes_progress": 1,
}


def exporter(agents: int) -> PrometheusExporter:
    """An exporter that has seen one step of a fleet of ``agents``."""
    out = PrometheusExporter()
    out.watch(
        LiveRun("r", "fedavg", "f", lambda: 11, lambda: 0, lambda: agents, lambda: agents, dict)
    )
    out.step_opened(0, Step(1, "train"))
    out.step_closed(RECORD)
    out.committed(0.001)
    out.replies_accepted(1)
    out.refused("late")
    out.heard([f"agent{i:05d}" for i in range(agents)], 1.7e9)
    return out


def main() -> None:
    for agents in (3, 10_000):
        e = exporter(agents)
        size = len(generate_latest(e.registry))
        seconds = timeit.timeit(functools.partial(generate_latest, e.registry), number=20) / 20
        print(f"{agents} agents: a scrape is {size} bytes and takes {seconds * 1e3:.1f} ms")
    e = exporter(3)
    events: dict[str, Callable[[], None]] = {
        "replies_accepted (once a batch)": lambda: e.replies_accepted(1),
        "heard (once an agent heard in a batch)": lambda: e.heard(["agent00001"], 1.7e9),
        "refused (once a refusal)": lambda: e.refused("late"),
        "committed (once a batch)": lambda: e.committed(0.001),
    }
    n = 200_000
    for name, call in events.items():
        print(f"{name}: {timeit.timeit(call, number=n) / n * 1e6:.2f} us")


if __name__ == "__main__":
    main()
