"""Closing a step that met its quorum: aggregate, train on the server, persist the global
state and the step's line of ``metrics.jsonl``."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from coordinator.config import RunConfig
from coordinator.engine.clock import Clock
from coordinator.engine.intake import ReplySource
from coordinator.engine.metrics import REFUSED, append_line, step_record
from coordinator.engine.observer import NoObserver, RunObserver
from coordinator.engine.step import OpenStep
from coordinator.engine.stopping import EarlyStop
from coordinator.store.database import Store
from coordinator.strategies import AgentInfo, ServerContext, Step, Strategy
from protocol.contract.messages import Reply
from protocol.errors import AggregationError
from protocol.transport.endpoint import Endpoint

__all__ = ["StepCloser"]


class StepCloser:
    """Folds a collected step into the global state and records it."""

    def __init__(
        self,
        cfg: RunConfig,
        store: Store,
        strategy: Strategy[Any],
        endpoint: Endpoint,
        *,
        replies: ReplySource,
        agents: Mapping[str, AgentInfo],
        log: logging.Logger,
        steps: int,
        stopping: EarlyStop,
        observer: RunObserver | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.cfg = cfg
        self.clock = clock or Clock()  # the records' time
        self.store = store
        self.strategy = strategy
        self.endpoint = endpoint
        self.replies = replies
        self.agents = agents  # the admitted agents (read only)
        self.log = log
        self.steps = steps  # in the run's plan
        self.stopping = stopping  # sees every record before it is stored
        self.observer = observer or NoObserver()  # sees every record once it is stored
        self.metrics_path = Path(cfg.run_dir) / "metrics.jsonl"

    def traffic_now(self) -> dict[str, int]:
        """The endpoint's accepted bytes by key, and its refused ones under ``refused.``: a
        step's figures are the difference between two of these."""
        traffic = self.endpoint.traffic
        refused = {REFUSED + k: n for k, n in traffic.refused_snapshot().items()}
        return {**traffic.snapshot(), **refused}

    def finish(
        self,
        open_step: OpenStep,
        started: float,
        traffic0: dict[str, int],
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Close ``open_step`` as done (as failed if its aggregation fails), storing ``meta``
        with it (buffered mode: the tasks still in flight)."""
        rec, step, outcome = open_step.rec, open_step.step, open_step.outcome
        ordered = [(self.agents[d], outcome.replies[d]) for d in sorted(outcome.replies)]
        try:
            agg = self._aggregate(rec.idx, step, ordered)
        except AggregationError as exc:
            self._fail_aggregation(open_step, exc, ordered, started, traffic0)
            for key, value in (meta or {}).items():  # its replies are quarantined, not in flight
                self.store.set_meta(key, value)
            return
        record = self._metrics_record(open_step, ordered, agg, started, traffic0)
        line = json.dumps(record)  # once: 10,000 agents' figures take 50 ms to encode
        self.store.complete_step(rec.idx, "done", self.strategy.state_dict(), line, meta)
        append_line(self.metrics_path, line)
        self.observer.step_closed(record)
        self.log.info(
            "step %d/%d %s round %d: %d/%d replies, local acc %s, global acc %s, %d bytes",
            rec.idx + 1,
            self.steps,
            step.phase,
            step.round,
            len(outcome.replies),
            len(rec.participants),
            _fmt(record["mean_acc_local"]),
            _fmt(record["mean_acc_global"]),
            record["bytes_total"],
        )

    def _aggregate(
        self, idx: int, step: Step, ordered: list[tuple[AgentInfo, Reply]]
    ) -> dict[str, float]:
        """The strategy's aggregation for the step's phase (none: nothing to fold), then
        server-side training."""
        agg = self.strategy.aggregate(step, ordered)
        ctx = ServerContext.for_step(self.cfg.seed, idx, self.cfg.server_device)
        return {**agg, **self.strategy.server_train(step, ctx)}

    def _fail_aggregation(
        self,
        open_step: OpenStep,
        exc: AggregationError,
        ordered: list[tuple[AgentInfo, Reply]],
        started: float,
        traffic0: dict[str, int],
    ) -> None:
        """Close the step as failed and go on: re-raising left it open, so every resume
        replayed the same stored replies into the same error and the run never moved again."""
        rec, step = open_step.rec, open_step.step
        self.log.error(
            "step %d (%s round %d) aggregation failed, step skipped: %s",
            rec.idx + 1,
            step.phase,
            step.round,
            exc,
        )
        # aggregate may have mutated the strategy before raising: back to the last good state
        self.strategy.load_state_dict(self.store.global_state())
        record = self._metrics_record(open_step, ordered, {}, started, traffic0)
        record.update(status="failed", error=f"{type(exc).__name__}: {exc}")
        line = json.dumps(record)
        self.store.fail_step(rec.idx, line, str(exc))
        append_line(self.metrics_path, line)
        self.observer.step_closed(record)

    def _metrics_record(
        self,
        open_step: OpenStep,
        ordered: list[tuple[AgentInfo, Reply]],
        agg: dict[str, float],
        started: float,
        traffic0: dict[str, int],
    ) -> dict[str, Any]:
        now = self.traffic_now()
        # a frame received before the step and refused in it moves out of an accepted count
        # the step did not see grow: never below zero
        traffic = {k: d for k, v in now.items() if (d := max(0, v - traffic0.get(k, 0)))}
        # the replies and acks the ingest workers moved (and refused)
        for key, n in self.replies.traffic(open_step.rec.idx).items():
            traffic[key] = traffic.get(key, 0) + n
        # refused frames are the senders' cost, not the algorithm's: counted apart, as are
        # progress heartbeats, the runtime's (they depend on the interval and training speed)
        refused_keys = [k for k in traffic if k.startswith(REFUSED)]
        refused = {k.removeprefix(REFUSED): traffic.pop(k) for k in refused_keys}
        progress = {k: traffic.pop(k) for k in list(traffic) if k.endswith(".progress")}
        record = step_record(
            open_step.step,
            open_step.rec.participants,
            open_step.outcome.failed,
            ordered,
            agg,
            started,
            self.clock.time(),
            traffic,
        )
        record["bytes_progress"] = sum(progress.values())
        record["deadline_s"] = open_step.deadline_s
        record["reply_s"] = {d: round(t, 3) for d, t in sorted(open_step.reply_s.items())}
        record["stragglers"] = open_step.stragglers
        record["bytes_refused"] = refused
        record["bytes_refused_total"] = sum(refused.values())
        if open_step.buffer_size:  # buffered: what each folded reply weighed, what was refused
            record["mode"] = "buffered"
            record["staleness"] = dict(sorted(open_step.staleness.items()))
            rule = self.cfg.staleness_rule()
            record["staleness_weight"] = {
                d: round(rule.weight(s), 6) for d, s in record["staleness"].items()
            }
            record["stale_refused"] = sorted(open_step.stale_refused)
            record["in_flight"] = sorted(open_step.outstanding)
        self.stopping.observe(record)
        return record


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
