"""Follow a run's ``metrics.jsonl`` and hand each step record to the tracking sinks."""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from coordinator import accuracy

__all__ = ["TRACKERS", "RunFollower", "Sink", "flatten", "make_sink", "start_tracking"]

log = logging.getLogger("edgefl.tracking")

TRACKERS = ("mlflow", "tensorboard")


class Sink(Protocol):
    """Where a run's figures go (one per tracking tool)."""

    name: str

    def log_params(self, params: Mapping[str, Any]) -> None: ...
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...
    def log_artifacts(self, folder: Path, name: str) -> None: ...
    def close(self) -> None: ...


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def flatten(record: Mapping[str, Any]) -> dict[str, float]:
    """One step record as flat scalar metrics: the round's summaries (personalised accuracy
    sample-weighted, global accuracy, their spread, loss), its traffic per message kind, its
    duration and participants, the aggregate's figures (``aggregate/...``) and every agent's
    own (``agent/<id>/...``)."""
    prefix = "" if record.get("phase") == "train" else f"{record.get('phase')}/"
    out: dict[str, float] = {}

    def put(key: str, value: object) -> None:
        number = _number(value)
        if number is not None:
            out[prefix + key] = number

    put("acc_local_weighted", accuracy.round_value(record, accuracy.PERSONALISED))
    for key in ("mean_acc_local", "mean_acc_global", "std_acc_local", "std_acc_global"):
        put(key, record.get(key))
    put("duration_s", record.get("duration_s"))
    put("bytes_total", record.get("bytes_total"))
    put("participants", len(record.get("participants") or ()))
    put("failed", len(record.get("failed") or {}))
    for kind, count in (record.get("bytes") or {}).items():
        put(f"bytes/{kind}", count)
    for key, value in (record.get("aggregate") or {}).items():
        put(f"aggregate/{key}", value)
    for device, agent in (record.get("agents") or {}).items():
        if isinstance(agent, Mapping):
            for key, value in agent.items():
                put(f"agent/{device}/{key}", value)
    return out


def make_sink(name: str, run_dir: Path, run_name: str, uri: str = "") -> Sink:
    """The sink of tracker ``name`` (its library imported only now)."""
    if name == "mlflow":
        from coordinator.tracking.mlflow_sink import MlflowSink

        return MlflowSink(run_dir, run_name, uri)
    if name == "tensorboard":
        from coordinator.tracking.tensorboard_sink import TensorBoardSink

        return TensorBoardSink(run_dir / "tensorboard")
    raise ValueError(f"unknown tracker {name!r}; known: {', '.join(TRACKERS)}")


class RunFollower:
    """Reads ``metrics.jsonl`` as it grows, from where it left off, and sends each complete
    record to every sink; a sink that raises is logged once and dropped."""

    def __init__(self, run_dir: Path, sinks: Iterable[Sink], poll_s: float = 1.0) -> None:
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self.sinks = list(sinks)
        self.poll_s = poll_s
        self._offset = 0
        self._step = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _each(self, what: str, call: Any) -> None:
        for sink in list(self.sinks):
            try:
                call(sink)
            except Exception as exc:  # a tracker's failure must never reach the run
                log.warning("tracker %s failed (%s: %s): dropped", sink.name, what, exc)
                self.sinks.remove(sink)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """The run's parameters (its configuration, flattened)."""
        self._each("params", lambda s: s.log_params(params))

    def poll(self) -> int:
        """Send every complete record appended since the last call; how many were sent."""
        try:
            with self.path.open("rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return 0
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
        sent = 0
        for line in data[:end].splitlines():
            self._offset += len(line) + 1
            try:
                record = json.loads(line)
            except ValueError:
                continue
            self._step += 1
            step = int(record.get("round") or self._step)
            metrics = flatten(record)
            self._each("metrics", lambda s, m=metrics, n=step: s.log_metrics(m, n))
            sent += 1
        return sent

    def start(self) -> None:
        """Follow in a background thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._loop, name="tracking", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def stop(self) -> None:
        """Send what is left and the exported bundles, then close every sink."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        self.poll()
        export = self.run_dir / "export"
        if export.is_dir():
            self._each("artifacts", lambda s: s.log_artifacts(export, "export"))
        self._each("close", lambda s: s.close())


def params_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """A run configuration as flat ``key`` / ``hyper.key`` parameters."""
    out = {k: v for k, v in config.items() if k != "hyper"}
    out.update({f"hyper.{k}": v for k, v in (config.get("hyper") or {}).items()})
    return out


def start_tracking(
    trackers: Iterable[str], run_dir: Path, run_name: str, config: Mapping[str, Any], uri: str = ""
) -> RunFollower | None:
    """A started follower of ``run_dir`` for ``trackers`` (None: none configured, or none could
    start: each failure logged, the run goes on)."""
    sinks: list[Sink] = []
    for name in trackers:
        try:
            sinks.append(make_sink(name, run_dir, run_name, uri))
        except Exception as exc:  # a missing extra, an unreachable server: the run goes on
            log.warning("tracker %s not started (%s: %s)", name, type(exc).__name__, exc)
    if not sinks:
        return None
    follower = RunFollower(run_dir, sinks)
    follower.log_params(params_of(config))
    follower.start()
    return follower
