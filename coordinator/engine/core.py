"""The round engine, written once: selection, dispatch, deadlines, quorum, persistence, metrics.

Every step of a run (each training round, then each final phase) goes through
:meth:`Coordinator.run_step`. The algorithm only fills the strategy's hooks. Messages from the
transport thread are queued; this thread alone touches the store and the strategy.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.config import RunConfig
from coordinator.engine.admission import Admission
from coordinator.engine.broadcast import KnowledgeBroadcast, build_tasks, send_tasks
from coordinator.engine.buffered import TaskBuffer, task_buffer
from coordinator.engine.clock import Clock
from coordinator.engine.closing import StepCloser
from coordinator.engine.deadlines import MISSES_REPORTED, DeadlineRule
from coordinator.engine.dispatch import MessageTable
from coordinator.engine.handlers import MessageHandlers
from coordinator.engine.ingest import new_share_group
from coordinator.engine.intake import Collector, ReplySource, reply_source
from coordinator.engine.liveness import Presence, StatePublisher
from coordinator.engine.observer import LiveRun, NoObserver, RunObserver
from coordinator.engine.replies import ReplyDesk, registered_agents
from coordinator.engine.step import OpenStep, QuorumError
from coordinator.engine.stopping import EarlyStop
from coordinator.ops.revocation import RevocationWatch
from coordinator.store.database import StepRecord, Store
from coordinator.strategies import Step, Strategy
from protocol.contract.codec import Envelope
from protocol.contract.messages import (
    ErrorReply,
    Fetch,
    Progress,
    Register,
    Reply,
    Status,
)
from protocol.contract.topics import Topics
from protocol.contract.wire import reuse_encodings
from protocol.errors import EdgeFLError
from protocol.logs import RefusalLog
from protocol.transport.endpoint import Endpoint

__all__ = ["Coordinator", "QuorumError", "RunResult"]


@dataclass
class RunResult:
    """Summary of a finished run."""

    run_id: str
    steps: int
    metrics: list[dict[str, Any]]
    rejected: dict[str, int]


class Coordinator(MessageHandlers):
    """Drives one run of one strategy over the agents of one federation."""

    def __init__(
        self,
        cfg: RunConfig,
        endpoint: Endpoint,
        store: Store,
        strategy: Strategy[Any],
        logger: logging.Logger | None = None,
        *,
        health_check: Callable[[], None] | None = None,
        revocations: Path | None = None,
        observer: RunObserver | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.cfg = cfg
        # where deadlines, reply times and the metrics' timestamps are read, and how the engine
        # waits (a simulation's clock passes a step's wait in simulated time)
        self.clock = clock or Clock()
        # called before every wait for messages; raises to end the run (the demo uses it to stop
        # at once when one of its agent processes dies instead of waiting out a deadline)
        self.health_check = health_check
        self.endpoint = endpoint
        self.store = store
        self.strategy = strategy
        # a live view of the run (a metrics exporter); told of each event where it happens
        self.observer: RunObserver = observer or NoObserver()
        if observer is not None:
            store.on_commit = observer.committed
        self.topics = Topics(cfg.federation)
        self.log = logger or logging.getLogger("edgefl.coordinator")
        self.inbox: queue.Queue[tuple[Envelope, str]] = queue.Queue()
        self.rejected: dict[str, int] = {}
        self.refusals = RefusalLog(self.log, what="messages")  # a flood: a few lines, then sums
        self._handling: Envelope | None = None  # the message being handled, until refused
        self.plan = strategy.plan(cfg.rounds)
        self.stopping = EarlyStop(cfg)
        self._open_step: OpenStep | None = None  # set only while collect() is waiting
        self.announcer = StatePublisher(
            cfg,
            endpoint,
            self.topics,
            strategy.name,
            strategy.declared_feature_dim(),
            class_counts=strategy.needs_class_counts,
        )
        self.presence = Presence()
        # the coordinator kit's revocation list: its devices are dropped, even mid-step
        watch = RevocationWatch(revocations, self.log) if revocations is not None else None
        self.admission = Admission(
            cfg,
            strategy,
            endpoint,
            self.presence,
            log=self.log,
            reject=self._reject,
            revocations=watch,
        )
        self.agents, self.refused = self.admission.agents, self.admission.refused
        self.online = self.presence.online
        self.buffer: TaskBuffer = task_buffer(cfg, store, self.clock)  # buffered mode's tasks
        self.desk = ReplyDesk(strategy, store)  # the reply checks, shared with ingest workers
        self.collector = Collector(
            self.desk,
            store,
            endpoint,
            self.topics,
            self.agents,
            log=self.log,
            reject=self._reject,
            observer=self.observer,
        )
        self.replies: ReplySource = reply_source(cfg, store, self.topics)
        self.broadcast = KnowledgeBroadcast(cfg, endpoint, self.topics, self._reject)
        self.deadlines = DeadlineRule(
            cfg.deadline_s,
            adaptive=cfg.deadline_mode == "adaptive",
            quantile=cfg.deadline_quantile,
            margin=cfg.deadline_margin,
            floor_s=cfg.deadline_min_s,
        )
        self.closer = StepCloser(
            cfg,
            store,
            strategy,
            endpoint,
            replies=self.replies,
            agents=self.agents,
            log=self.log,
            steps=len(self.plan),
            stopping=self.stopping,
            observer=self.observer,
            clock=self.clock,
        )
        self.messages = (
            MessageTable()
            .on(Register, self._on_register)
            .on(Status, lambda env, status: self.presence.on_status(env.sender, status))
            .on(Reply, lambda env, reply: self.collector.on_reply(env, reply, self._open_step))
            .on(Fetch, self._on_fetch)
            .on(ErrorReply, self._on_error)
            .on(Progress, self._on_progress)
        )
        self._restore()

    @property
    def deferred(self) -> int:
        """Replies that arrived while no step was open (left unacknowledged)."""
        return self.collector.deferred

    # ----- start-up -------------------------------------------------------------------------
    def _restore(self) -> None:
        self.agents.update(registered_agents(self.store))
        self.strategy.load_state_dict(self.store.global_state())
        if self.stopping.enabled:  # the best round so far, from the stored rounds
            self.stopping.replay(self.store.metrics())
            self._cut_plan()
        if self.store.get_meta("run_id") is None:
            self.store.set_meta("run_id", self.cfg.run_id)
            new_share_group(self.store)  # before the config: workers start once it is there
            self.store.set_meta("config", self.cfg.to_dict())

    def start(self) -> None:
        """Subscribe to the agents' topics; announce the coordinator on every (re)connect.

        Subscribing before ``transport.connect()`` also delivers what the broker queued for
        the coordinator's persistent session while it was down.
        """
        base = self.topics.base
        # The endpoint drops a message id it has seen; a reply is the exception: one deferred
        # (no step open) or whose ack was lost comes again with the same id, and only the
        # engine knows whether to accept it now, acknowledge it again or refuse it.
        self.endpoint.on_duplicate = self._on_duplicate
        for pattern in self.replies.subscriptions(base):
            self.endpoint.subscribe(pattern, lambda env, topic: self.inbox.put((env, topic)))
        for topic in self.replies.leader_topics(base):
            self.endpoint.deliver_locally(topic, lambda env, topic: self.inbox.put((env, topic)))
        self.endpoint.transport.add_connect_listener(self.announcer.on_connect)
        self.observer.watch(self._live())
        self.announcer.state = ("starting", 0)
        if self.endpoint.transport.connected:
            self.announcer.announce()

    def _live(self) -> LiveRun:
        """The run's live values, read by the observer when it asks (from its own thread:
        each is one atomic read or copy of a builtin container)."""
        return LiveRun(
            run_id=self.cfg.run_id,
            algorithm=self.strategy.name,
            federation=self.cfg.federation,
            steps=lambda: len(self.plan),
            queue_depth=self.inbox.qsize,
            agents_registered=lambda: len(self.agents),
            agents_online=self.admission.online_count,
            frames_refused=lambda: dict(self.endpoint.rejected),
        )

    def _on_duplicate(self, env: Envelope, topic: str) -> None:
        if isinstance(env.body, Reply):
            self.inbox.put((env, topic))

    # ----- the run --------------------------------------------------------------------------
    def run(self) -> RunResult:
        """Wait for agents, then run every remaining step of the plan."""
        first = self.store.last_closed_step() + 1
        self.store.set_meta("outcome", "running")
        try:
            self._run_steps(first)
        except QuorumError:
            self._flush_refusals()
            self.store.set_meta("outcome", "failed")
            # agents must not wait for a coordinator that gave up: the retained state ends it
            self.announcer.publish("finished", self.announcer.state[1])
            raise
        self._flush_refusals()
        self.store.set_meta("outcome", "finished")
        # the cap even after an early stop: agents read a lower round as a coordinator that gave up
        self.announcer.publish("finished", self.cfg.rounds)
        self.broadcast.clear()
        return RunResult(self.cfg.run_id, len(self.plan), self.store.metrics(), dict(self.rejected))

    def _flush_refusals(self) -> None:
        """The refusals not logged one by one, summed up (the engine's and the endpoint's)."""
        self.refusals.flush()
        self.endpoint.refusals.flush()

    def interrupted(self) -> None:
        """Ctrl-C or SIGTERM: mark the run resumable and tell the fleet we are gone.

        Every acknowledged update is already committed (an interrupted batch rolls back and
        its replies stay unacknowledged in the agents' outboxes), so nothing else needs saving.
        """
        self.store.set_meta("outcome", "interrupted")
        with contextlib.suppress(EdgeFLError):  # best effort: the broker may be gone too
            self.announcer.publish("offline", self.announcer.state[1])

    def _run_steps(self, first: int) -> None:
        if first < len(self.plan):
            self.wait_for_agents(self.cfg.min_agents, self.cfg.wait_agents_s)
            self.replies.wait_ready(self._pump, self.cfg.wait_agents_s, self.log)
            self.announcer.publish("running", self.plan[first].round)
        if first:
            self.log.info("resuming at step %d of %d", first + 1, len(self.plan))
        idx = first
        while idx < len(self.plan):  # an early stop shortens the plan
            self.run_step(idx, self.plan[idx])
            self._cut_plan()
            idx += 1
        self.store.retire_done_steps()  # the last step's replies: nothing waits for them now

    def _cut_plan(self) -> None:
        """Drop the training rounds an early stop left out of the plan."""
        plan = self.stopping.cut(self.plan, self.strategy)
        if plan is not self.plan:
            assert self.stopping.decision is not None  # cut only after a decision
            self.log.info("%s; running the final steps", self.stopping.decision.describe(self.cfg))
            self.plan = plan
            self.closer.steps = len(plan)

    def wait_for_agents(self, count: int, timeout: float) -> None:
        """Process messages until ``count`` agents are registered and online."""
        self.admission.wait_for(count, timeout, self._pump)

    def _online_agents(self) -> list[str]:
        return self.admission.online_agents()

    def run_step(self, idx: int, step: Step) -> None:
        """One step: select, dispatch, collect until quorum and deadline, aggregate, persist."""
        rec = self.store.step(idx)
        if rec is None or rec.status != "open":
            rec = self._open(idx, step, attempt=0)
        while True:
            self.observer.step_opened(idx, step)
            started, traffic0 = self.clock.time(), self.closer.traffic_now()
            open_step = self.collect(rec, step)
            self._observe_deadline(open_step)
            outcome = open_step.outcome
            needed = open_step.quorum(self.cfg.min_replies, self.cfg.quorum_fraction)
            if len(outcome.replies) >= needed:
                meta = self.buffer.fold(open_step, self.strategy)  # weighs the replies
                self.closer.finish(open_step, started, traffic0, meta)
                return
            self.log.warning(
                "step %d (%s round %d) missed quorum: %d of %d needed valid replies; failed: %s",
                idx + 1,
                step.phase,
                step.round,
                len(outcome.replies),
                needed,
                outcome.failed or "none",
            )
            if rec.attempt >= self.cfg.max_retries:
                record = {"round": step.round, "phase": step.phase, "quorum_met": False}
                self.store.complete_step(idx, "failed", {}, json.dumps(record))
                self.announcer.state = (self.announcer.state[0], step.round)  # run() publishes
                raise QuorumError(
                    f"step {idx + 1} ({step.phase}, round {step.round}) missed quorum "
                    f"{rec.attempt + 1} times; stopping the run{_commonest(outcome.failed)}"
                    f"{_deadline_hint(outcome.failed, open_step.deadline_s)}"
                )
            if not open_step.buffer_size:  # a buffered step keeps its replies for the next try
                self.store.clear_updates(idx)
            rec = self._open(idx, step, attempt=rec.attempt + 1)

    def _open(self, idx: int, step: Step, attempt: int) -> StepRecord:
        end = time.monotonic() + self.cfg.rejoin_wait_s
        while self.admission.online_count() < self.cfg.min_agents and time.monotonic() < end:
            self._pump(min(0.5, max(0.0, end - time.monotonic())))  # let restarted agents rejoin
        online = self.admission.selectable(self._online_agents(), step.phase)
        if not online:
            where = f"step {idx + 1} ({step.phase}, round {step.round})"
            raise QuorumError(f"{where}: no agent online{self.admission.spent_note()}")
        selected = self.strategy.select(idx, step, online, self.cfg.fraction)
        participants = self.buffer.participants(step, selected)  # buffered: and the busy ones
        rec = StepRecord(idx, step.round, step.phase, participants, "open", attempt)
        self.store.open_step(rec)
        return rec

    # ----- collecting replies ---------------------------------------------------------------
    def collect(self, rec: StepRecord, step: Step) -> OpenStep:
        """Send tasks to participants without a stored update and wait for their replies."""
        open_step = OpenStep(rec, step, now=self.clock.time)
        # the dimension replies must have, from the participants' registrations (never a reply)
        self.strategy.observe_fleet(self.agents[d] for d in rec.participants if d in self.agents)
        self.collector.take_stored(open_step, worker_checked=False)  # a resumed step's: every check
        self.admission.withdraw_revoked(open_step)  # revoked since it was opened (a resume)
        due = self.deadlines.next()
        if self.deadlines.adaptive:
            self.log.info("step %d: deadline %.1f s, %s", rec.idx + 1, due.seconds, due.reason)
        open_step.deadline_s = due.seconds
        deadline = self.clock.time() + due.seconds
        again, restored = self.buffer.open(open_step, self.collector)  # buffered: in flight
        config = self.strategy.config.task_config()  # the same for every task of the step
        payloads = {
            d: self.strategy.configure(step, self.agents[d])
            for d in rec.participants
            if open_step.needs_task(d)
        }
        # what several tasks still share is encoded once, and the fields all tasks share
        # (config, run id, deadline) once a step (protocol.contract.wire.reuse_encodings)
        with reuse_encodings():
            payloads, shared, knowledge = self.broadcast.split(step, payloads)
            tasks = build_tasks(
                open_step,
                run_id=self.cfg.run_id,
                algorithm=self.strategy.name,
                deadline=deadline,
                config=config,
                payloads=payloads,
                shared=shared,
            )
            self.broadcast.open(knowledge)  # before the tasks that name it
            self.replies.open(open_step)  # before the tasks: their replies may come at once
            open_step.dispatched = self.clock.time()
            again.update(TaskBuffer.rebuild(tasks, restored))
            send_tasks(self.endpoint, self.topics, open_step, tasks)
        for device, task in again.items():  # each its own round: not spliced with the step's
            open_step.sent(device, task)
            self._send_task(device, task)
        self.buffer.save(open_step)
        self.announcer.publish_round(step, deadline, rec.participants)
        self._open_step = open_step
        # the steps done before this one give their replies' rows and bytes up here, once the
        # tasks are out (~50 ms at 10,000 agents), not in the previous step's close
        self.store.retire_done_steps()
        try:
            self._wait_for_replies(open_step, deadline + self.cfg.grace_s)
        finally:
            self._open_step = None
        self.collector.take_rows(open_step, self.replies.unread(open_step), worker_checked=True)
        return open_step

    def _observe_deadline(self, open_step: OpenStep) -> None:
        """Feed the step's reply times and deadline misses to the deadline rule; report the
        devices that keep missing it."""
        missed = [d for d, why in open_step.outcome.failed.items() if why.startswith("deadline")]
        open_step.stragglers = self.deadlines.observe(open_step.reply_s, missed)
        if open_step.stragglers:
            self.log.warning(
                "missed the deadline in %d or more steps in a row: %s",
                MISSES_REPORTED,
                ", ".join(open_step.stragglers),
            )

    def _wait_for_replies(self, open_step: OpenStep, end: float) -> None:
        while open_step.outstanding and not open_step.full:
            remaining = end - self.clock.time()
            if remaining <= 0:
                break
            self._pump(min(remaining, self.replies.poll_s), for_replies=True)
            self.collector.take_polled(open_step, self.replies.poll(open_step))
        # closed before the deadline's verdict: none slips in
        self.collector.take_polled(open_step, self.replies.close(open_step))
        if not open_step.full:  # a full buffered step: the others keep their tasks
            open_step.expire()

    def _pump(self, timeout: float, *, for_replies: bool = False) -> None:
        """Handle what arrived (waiting up to ``timeout`` for the first message; ``for_replies``:
        an open step's wait, which a simulated clock passes in simulated time).

        Group commit: everything already queued is handled in one transaction, and the acks
        leave only after it commits, so an acknowledged update is durable while a burst of N
        replies costs one fsync instead of N (1000 agents: see benchmarks/bench_coordinator.py).
        """
        if self.health_check is not None:
            self.health_check()
        self.announcer.heartbeat()
        self.refusals.tick()  # a flood's summary line, once its interval is over
        self.endpoint.refusals.tick()
        self.admission.poll_revocations(self._open_step)
        batch = self.clock.take(self.inbox, timeout, for_replies=for_replies)
        if not batch:
            return
        now = time.time()  # the batch's agents' last_seen
        with self.store.transaction():
            self.desk.prefetch([env.msg_id for env, _ in batch if isinstance(env.body, Reply)])
            for env, topic in batch:
                self._handle(env, topic)
            self.collector.flush()  # one statement a batch, before its acks leave
            joined = self.admission.flush(self.store, now)  # one statement a batch,
            heard = self.presence.flush(self.store, now)  # and after them what they said since
        self.collector.send_acks()
        if joined or heard:
            self.observer.heard([*joined, *heard], now)


def _deadline_hint(failed: dict[str, str], deadline_s: float) -> str:
    """What to change when every failed device ran out of time (a fleet slower than the
    deadline misses every retry of the step too)."""
    if not failed or not all(why.startswith("deadline") for why in failed.values()):
        return ""
    return (
        f" (every failed device missed the {deadline_s:g} s deadline: a fleet this slow needs "
        "a longer run.deadline_s)"
    )


def _commonest(failed: dict[str, str]) -> str:
    """The failure most devices of a step share, for the run's last error (a fleet that misses
    its quorum mostly does so for one reason: a refused reply shape, a deadline)."""
    if not failed:
        return ""
    reason, count = Counter(failed.values()).most_common(1)[0]
    return f"; {count} of {len(failed)} failed devices: {reason}"
