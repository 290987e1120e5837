"""Prometheus exporter of a live run (``coordinator serve --metrics-port``): the engine's
:class:`~coordinator.engine.observer.RunObserver`, served on ``/metrics``.

Names follow Prometheus' conventions: the ``edgefl_`` prefix, base units (seconds, bytes, a
ratio), ``_total`` on counters. Every label has a bounded set of values (a refusal reason, a
message kind, a phase) but ``agent`` on the per-agent last seen, one series per admitted
device (at most ``run.max_agents``). Reference: ``docs/howto/monitor-with-prometheus.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.metrics_core import Metric

from coordinator import accuracy
from coordinator.engine.observer import LiveRun
from coordinator.strategies import Step
from protocol.errors import ConfigError

__all__ = ["COMMIT_BUCKETS", "MetricsServer", "PrometheusExporter"]

# a `_created` series beside every counter doubles the series and no panel reads them
disable_created_metrics()  # type: ignore[no-untyped-call]

#: The commit-latency histogram's buckets, seconds: an fsync on an SSD to a stalled disk.
COMMIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
#: The accuracy measures of a step (:mod:`coordinator.accuracy`), by the record's key.
ACCURACIES = {"acc_local": "mean_acc_local", "acc_global": "mean_acc_global"}


class _Live:
    """The values read at each scrape, from the run's :class:`LiveRun` (none before it
    starts: an info or gauge without its run would be a series of its own)."""

    def __init__(self) -> None:
        self.run: LiveRun | None = None

    def describe(self) -> list[Metric]:
        """The families' names, for the registry's duplicate check."""
        return list(self._families(None))

    def collect(self) -> Iterator[Metric]:
        """The live values (none before the run starts)."""
        if self.run is not None:
            yield from self._families(self.run)

    @staticmethod
    def _families(run: LiveRun | None) -> Iterator[Metric]:
        def gauge(name: str, doc: str, value: Callable[[LiveRun], float]) -> Metric:
            return GaugeMetricFamily(name, doc, value=None if run is None else value(run))

        info = None
        if run is not None:
            info = {"run_id": run.run_id, "algorithm": run.algorithm, "federation": run.federation}
        yield InfoMetricFamily("edgefl_run", "The run this coordinator serves", value=info)
        yield gauge("edgefl_steps_planned", "Steps in the run's plan", lambda r: r.steps())
        yield gauge(
            "edgefl_ingest_queue_messages",
            "Messages received and waiting for the engine's thread",
            lambda r: r.queue_depth(),
        )
        yield gauge(
            "edgefl_agents_registered",
            "Agents admitted to the run",
            lambda r: r.agents_registered(),
        )
        yield gauge("edgefl_agents_online", "Admitted agents online", lambda r: r.agents_online())
        frames = CounterMetricFamily(
            "edgefl_frames_refused",
            "Frames the transport refused before the engine saw them, by reason",
            labels=["reason"],
        )
        for reason, count in sorted(run.frames_refused().items() if run is not None else ()):
            frames.add_metric([reason], count)
        yield frames


class PrometheusExporter:
    """The run's metrics in a registry of their own (several runs in one process do not mix)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.round = Gauge(
            "edgefl_round", "Training round of the step open or last open", registry=r
        )
        self.step = Gauge(
            "edgefl_step", "Step open or last open, 1-based in the run's plan", registry=r
        )
        self.steps_closed = Counter(
            "edgefl_steps_closed",
            "Steps closed, by phase and status",
            ["phase", "status"],
            registry=r,
        )
        self.replies = Counter("edgefl_replies_accepted", "Replies taken into a step", registry=r)
        self.refusals = Counter(
            "edgefl_messages_refused",
            "Messages the engine refused, by reason",
            ["reason"],
            registry=r,
        )
        self.bytes = Counter(
            "edgefl_message_bytes",
            "Bytes of accepted messages by direction and kind, added at each step's close",
            ["direction", "kind"],
            registry=r,
        )
        self.refused_bytes = Counter(
            "edgefl_refused_bytes",
            "Bytes of refused frames by direction and kind, added at each step's close",
            ["direction", "kind"],
            registry=r,
        )
        self.last_seen = Gauge(
            "edgefl_agent_last_seen_timestamp_seconds",
            "When each agent was last heard from (Unix time, as the store holds it)",
            ["agent"],
            registry=r,
        )
        self.duration = Gauge(
            "edgefl_step_duration_seconds",
            "Duration of the last closed step, by phase",
            ["phase"],
            registry=r,
        )
        self.accuracy = Gauge(
            "edgefl_accuracy_ratio",
            "Accuracy of the last closed step, by phase and measure",
            ["phase", "measure"],
            registry=r,
        )
        self.commit = Histogram(
            "edgefl_store_commit_duration_seconds",
            "Time each store transaction's COMMIT took (the group commit of a batch of replies)",
            buckets=COMMIT_BUCKETS,
            registry=r,
        )
        # each label's child, looked up once: labels() costs ~10 us, a dict lookup ~0.1 us,
        # and these two run per message heard and per refusal (a flood of forgeries)
        self._seen: dict[str, Gauge] = {}
        self._refused: dict[str, Counter] = {}
        self.live = _Live()
        r.register(self.live)
        ProcessCollector(registry=r)  # the coordinator's own memory, CPU and open files

    # ----- RunObserver ----------------------------------------------------------------------
    def watch(self, run: LiveRun) -> None:
        """The run starts."""
        self.live.run = run

    def step_opened(self, idx: int, step: Step) -> None:
        """A step collects replies."""
        self.round.set(step.round)
        self.step.set(idx + 1)

    def step_closed(self, record: Mapping[str, Any]) -> None:
        """A step's record: its status, duration, accuracy and traffic."""
        phase = str(record.get("phase"))
        self.steps_closed.labels(phase, str(record.get("status", "done"))).inc()
        self.duration.labels(phase).set(float(record.get("duration_s") or 0.0))
        measures = {m: record.get(key) for m, key in ACCURACIES.items()}
        measures[accuracy.PERSONALISED] = accuracy.round_value(record, accuracy.PERSONALISED)
        for measure, value in measures.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.accuracy.labels(phase, measure).set(value)
        _add(self.bytes, record.get("bytes") or {})
        _add(self.refused_bytes, record.get("bytes_refused") or {})
        if record.get("bytes_progress"):  # an agent's progress heartbeats, summed by the record
            self.bytes.labels("rx", "progress").inc(record["bytes_progress"])

    def replies_accepted(self, count: int) -> None:
        """Replies taken into the open step."""
        self.replies.inc(count)

    def refused(self, reason: str) -> None:
        """A message the engine refused."""
        child = self._refused.get(reason)
        if child is None:
            child = self._refused[reason] = self.refusals.labels(reason)
        child.inc()

    def heard(self, devices: Iterable[str], when: float) -> None:
        """Agents heard from at ``when``."""
        seen = self._seen
        for device in devices:
            child = seen.get(device)
            if child is None:
                child = seen[device] = self.last_seen.labels(device)
            child.set(when)

    def committed(self, seconds: float) -> None:
        """A store commit's latency."""
        self.commit.observe(seconds)


def _add(counter: Counter, traffic: Mapping[str, Any]) -> None:
    """Add a record's ``{"rx.reply": bytes, ...}`` to ``counter`` by direction and kind."""
    for key, count in traffic.items():
        direction, _, kind = key.partition(".")
        if kind and isinstance(count, int) and count > 0:
            counter.labels(direction, kind).inc(count)


class MetricsServer:
    """An exporter served over HTTP on ``host:port`` (``/metrics``; port 0: a free one, then
    in ``.port``) until :meth:`close`."""

    def __init__(self, host: str, port: int) -> None:
        self.exporter = PrometheusExporter()
        try:
            self._server, self._thread = start_http_server(
                port, addr=host, registry=self.exporter.registry
            )
        except OSError as exc:
            raise ConfigError(f"--metrics-port: cannot listen on {host}:{port}: {exc}") from exc
        self.host, self.port = host, int(self._server.server_port)

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
