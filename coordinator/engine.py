"""The round engine, written once: selection, dispatch, deadlines, quorum, persistence, metrics.

Every step of a run (each training round, then each final phase) goes through
:meth:`Coordinator.run_step`. The algorithm only fills the strategy's hooks. Messages from the
transport thread are queued; this thread alone touches the store and the strategy.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import queue
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from coordinator.config import RunConfig
from coordinator.ingest import POLL_S, Polled, WorkerIntake, new_share_group
from coordinator.metrics import append_line, step_record
from coordinator.replies import (
    AckFrames,
    ReplyDesk,
    is_will,
    registered_agents,
    screen,
    take_batch,
    task_id,
)
from coordinator.store import StepRecord, Store
from coordinator.strategies import AgentInfo, ServerContext, Step, Strategy
from protocol.codec import Envelope, FrameTemplate, decode, encode, new_message_id
from protocol.endpoint import Endpoint
from protocol.errors import (
    AdmissionError,
    AggregationError,
    EdgeFLError,
    LimitError,
    ProtocolError,
    ValidationError,
)
from protocol.logs import listing
from protocol.messages import (
    REFUSED,
    UNKNOWN_KNOWLEDGE,
    Ack,
    CoordinatorState,
    ErrorReply,
    Fetch,
    Knowledge,
    Progress,
    Register,
    Reply,
    RoundDescriptor,
    Status,
    Task,
)
from protocol.payloads import Payload, pack_payloads
from protocol.topics import Topics
from protocol.wire import reuse_encodings

StateName = Literal["starting", "running", "finished", "offline"]
REGISTRATIONS_LOGGED = 100  # new agents logged one line each; past that, one line a thousand

__all__ = ["Coordinator", "QuorumError", "RunResult"]


class QuorumError(EdgeFLError):
    """A step missed its quorum more often than ``max_retries`` allows."""


@dataclass
class StepOutcome:
    """Replies of one step attempt and what happened to the others."""

    replies: dict[str, Reply] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # device -> reason
    late: int = 0


@dataclass
class OpenStep:
    """The step whose replies are being collected: one object instead of four optionals."""

    rec: StepRecord
    step: Step
    outcome: StepOutcome = field(default_factory=StepOutcome)
    tasks: dict[str, Task] = field(default_factory=dict)  # device -> task sent this attempt
    # devices with a task in flight that have neither replied nor failed, kept up to date by
    # the three methods below: the wait loop tests it every pass, and recomputing it from the
    # three dicts cost 1.3-1.9 ms a pass at 10,000 agents (issue 21)
    outstanding: set[str] = field(default_factory=set)
    read: set[str] = field(default_factory=set)  # devices whose stored reply was taken

    def sent(self, device: str, task: Task) -> None:
        """A task went out to ``device``."""
        self.tasks[device] = task
        if device not in self.outcome.replies and device not in self.outcome.failed:
            self.outstanding.add(device)

    def replied(self, device: str, reply: Reply) -> None:
        """``device``'s reply was accepted."""
        self.outcome.replies[device] = reply
        self.outstanding.discard(device)

    def fail(self, device: str, reason: str) -> None:
        """``device`` will not deliver a valid reply this attempt."""
        self.outcome.failed[device] = reason
        self.outstanding.discard(device)

    def stored(self, device: str) -> None:
        """An ingest worker stored ``device``'s reply (the engine takes it from the store)."""
        self.outstanding.discard(device)

    def waiting_for(self) -> set[str]:
        """Devices with a task in flight that have neither replied nor failed."""
        return set(self.outstanding)


@dataclass
class RunResult:
    """Summary of a finished run."""

    run_id: str
    steps: int
    metrics: list[dict[str, Any]]
    rejected: dict[str, int]


class Coordinator:
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
    ) -> None:
        self.cfg = cfg
        # called before every wait for messages; raises to end the run (the demo uses it to stop
        # at once when one of its agent processes dies instead of waiting out a deadline)
        self.health_check = health_check
        self.endpoint = endpoint
        self.store = store
        self.strategy = strategy
        self.topics = Topics(cfg.federation)
        self.log = logger or logging.getLogger("edgefl.coordinator")
        self.inbox: queue.Queue[tuple[Envelope, str]] = queue.Queue()
        self.agents: dict[str, AgentInfo] = {}
        self.online: set[str] = set()
        self.rejected: dict[str, int] = {}
        self.refused: dict[str, str] = {}  # device -> why its latest registration was refused
        self.deferred = 0  # replies that arrived while no step was open (left unacknowledged)
        self.plan = strategy.plan(cfg.rounds)
        self.metrics_path = Path(cfg.run_dir) / "metrics.jsonl"
        self._open_step: OpenStep | None = None  # set only while collect() is waiting
        self._state: tuple[StateName, int] = ("starting", 0)  # last published coordinator state
        self._next_heartbeat = 0.0  # monotonic time to publish the retained state again
        self._acks: list[tuple[str, Ack]] = []  # acks waiting for their batch to commit
        self._ack_frames = AckFrames(endpoint)
        self._updates: list[tuple[int, str, str, str, bytes]] = []  # the batch's accepted replies
        self._touched: dict[str, bool | None] = {}  # agents heard from in the batch: online?
        self._registered: dict[str, bytes] = {}  # registrations of the batch: their frames
        self.desk = ReplyDesk(strategy, store)  # the reply checks, shared with ingest workers
        # None: replies come to this process (the default); else ingest workers store them
        self.intake = (
            WorkerIntake(cfg.ingest_workers, store, self.topics) if cfg.ingest_workers else None
        )
        # the open step's shared knowledge (None: its tasks carry all their payloads), kept to
        # answer a `fetch`; rebuilt by a resumed step (configure is deterministic)
        self._knowledge: Knowledge | None = None
        self._knowledge_sent = False  # some knowledge went out retained: clear it at the end
        self._restore()

    # ----- start-up -------------------------------------------------------------------------
    def _restore(self) -> None:
        self.agents.update(registered_agents(self.store))
        self.strategy.load_state_dict(self.store.global_state())
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
        patterns = [f"{base}/dev/+/up/#", f"{base}/dev/+/status", f"{base}/dev/+/progress"]
        if self.intake is not None:  # the replies go to the ingest workers
            patterns = self.intake.subscriptions(base)
        for pattern in patterns:
            self.endpoint.subscribe(pattern, lambda env, topic: self.inbox.put((env, topic)))
        if self.intake is not None:  # chunked replies: their chunks come to the leader
            reply = f"{base}/dev/+/up/reply"
            self.endpoint.deliver_locally(reply, lambda env, topic: self.inbox.put((env, topic)))
        self.endpoint.transport.add_connect_listener(self._on_connect)
        self._state = ("starting", 0)
        if self.endpoint.transport.connected:
            self._announce()

    def _on_duplicate(self, env: Envelope, topic: str) -> None:
        if isinstance(env.body, Reply):
            self.inbox.put((env, topic))

    def _announce(self) -> None:
        # retained state is lost when a broker without persistence restarts: publish it again
        self._publish_state(*self._state)

    def _on_connect(self, session_present: bool) -> None:
        state, round_ = self._state
        if not session_present and state == "running":
            # The broker lost our session (a restart without persistence): whatever agents
            # sent before we subscribed again is gone, including the registration and the
            # resent replies of an agent that reconnected first, and `running` alone does not
            # make agents announce again. `starting` does (register, resend unacknowledged
            # replies; a new agent session gets its task again); duplicates are deduplicated.
            self._publish_state("starting", round_)
        self._publish_state(state, round_)

    def _publish_state(self, state: StateName, round_: int) -> None:
        self._state = (state, round_)
        body = CoordinatorState(
            state=state,
            run_id=self.cfg.run_id,
            algorithm=self.strategy.name,
            round=round_,
            total_rounds=self.cfg.rounds,
            classes=list(self.cfg.classes),
            feature_dim=self.strategy.declared_feature_dim(),
        )
        self.endpoint.send(self.topics.coord_state, body, retain=True)
        self._next_heartbeat = time.monotonic() + self.cfg.state_heartbeat_s

    def _heartbeat(self) -> None:
        """Publish the retained state again, freshly signed, every ``state_heartbeat_s``.

        A signed frame is refused once its timestamp is older than the replay window (300 s,
        ``WIRE.md`` §7), so a retained state published once would be refused by every agent
        joining later; a fresh one also replaces, within one interval, a forged retained state
        that a broker without ACL let through. Unsigned states never go stale: no heartbeat.
        """
        if self.endpoint.signer is None or time.monotonic() < self._next_heartbeat:
            return
        with contextlib.suppress(EdgeFLError):  # a broker gone for now: the next pass retries
            self._publish_state(*self._state)

    # ----- the run --------------------------------------------------------------------------
    def run(self) -> RunResult:
        """Wait for agents, then run every remaining step of the plan."""
        first = self.store.last_closed_step() + 1
        self.store.set_meta("outcome", "running")
        try:
            self._run_steps(first)
        except QuorumError:
            self.store.set_meta("outcome", "failed")
            # agents must not wait for a coordinator that gave up: the retained state ends it
            self._publish_state("finished", self._state[1])
            raise
        self.store.set_meta("outcome", "finished")
        self._publish_state("finished", self.cfg.rounds)
        self._clear_knowledge()
        return RunResult(self.cfg.run_id, len(self.plan), self.store.metrics(), dict(self.rejected))

    def interrupted(self) -> None:
        """Ctrl-C or SIGTERM: mark the run resumable and tell the fleet we are gone.

        Every acknowledged update is already committed (an interrupted batch rolls back and
        its replies stay unacknowledged in the agents' outboxes), so nothing else needs saving.
        """
        self.store.set_meta("outcome", "interrupted")
        with contextlib.suppress(EdgeFLError):  # best effort: the broker may be gone too
            self._publish_state("offline", self._state[1])

    def _run_steps(self, first: int) -> None:
        if first < len(self.plan):
            self.wait_for_agents(self.cfg.min_agents, self.cfg.wait_agents_s)
            self._wait_for_workers(self.cfg.wait_agents_s)
            self._publish_state("running", self.plan[first].round)
        if first:
            self.log.info("resuming at step %d of %d", first + 1, len(self.plan))
        for idx in range(first, len(self.plan)):
            self.run_step(idx, self.plan[idx])
        self.store.retire_done_steps()  # the last step's replies: nothing waits for them now

    def _refusals(self) -> str:
        """Why agents were refused (for a quorum error: the cause is otherwise only in the
        agents' logs), e.g. FedAvg refusing a second architecture."""
        if not self.refused:
            return ""
        reasons = Counter(self.refused.values()).most_common(3)
        listed = "; ".join(f"{n} x {reason}" for reason, n in reasons)
        return f"; {len(self.refused)} refused at registration: {listed}"

    def wait_for_agents(self, count: int, timeout: float) -> None:
        """Process messages until ``count`` agents are registered and online."""
        end = time.monotonic() + timeout
        if self._online_count() < count:
            self.log.info(
                "waiting for %d agents of federation %s (up to %.0f s)",
                count,
                self.cfg.federation,
                timeout,
            )
        while self._online_count() < count:
            if time.monotonic() > end:
                raise QuorumError(
                    f"only {self._online_count()} of {count} required agents "
                    f"registered within {timeout:.0f} s{self._refusals()}"
                )
            self._pump(min(0.5, max(0.0, end - time.monotonic())))
        online = self._online_agents()
        self.log.info("%d agents online: %s", len(online), listing(online, REGISTRATIONS_LOGGED))

    def _wait_for_workers(self, timeout: float) -> None:
        """With ingest workers, wait until ``run.ingest_workers`` of them are online: a reply
        published while no member holds the shared subscription is dropped by the broker."""
        if self.intake is None:
            return
        end = time.monotonic() + timeout
        while len(self.intake.online) < self.intake.count:
            if time.monotonic() > end:
                raise QuorumError(
                    f"only {len(self.intake.online)} of {self.intake.count} ingest workers "
                    f"online within {timeout:.0f} s"
                )
            self._pump(min(0.5, max(0.0, end - time.monotonic())))
        self.log.info("%d ingest workers online", len(self.intake.online))

    def _online_agents(self) -> list[str]:
        return sorted(d for d in self.agents if d in self.online and d not in self.refused)

    def _online_count(self) -> int:
        """``len(self._online_agents())`` with set operations in C: the registration wait asks
        on every pass of its loop, and sorting 10,000 ids each time cost seconds (issue 21)."""
        return len((self.online & self.agents.keys()) - self.refused.keys())

    def run_step(self, idx: int, step: Step) -> None:
        """One step: select, dispatch, collect until quorum and deadline, aggregate, persist."""
        rec = self.store.step(idx)
        if rec is None or rec.status != "open":
            rec = self._open(idx, step, attempt=0)
        while True:
            started, traffic0 = time.time(), self.endpoint.traffic.snapshot()
            open_step = self.collect(rec, step)
            outcome = open_step.outcome
            needed = max(
                self.cfg.min_replies, math.ceil(self.cfg.quorum_fraction * len(rec.participants))
            )
            if len(outcome.replies) >= needed:
                self._finish(open_step, started, traffic0)
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
                self.store.complete_step(
                    idx,
                    "failed",
                    {},
                    json.dumps({"round": step.round, "phase": step.phase, "quorum_met": False}),
                )
                self._state = (self._state[0], step.round)  # run() publishes the end
                raise QuorumError(
                    f"step {idx + 1} ({step.phase}, round {step.round}) missed quorum "
                    f"{rec.attempt + 1} times; stopping the run"
                )
            self.store.clear_updates(idx)
            rec = self._open(idx, step, attempt=rec.attempt + 1)

    def _open(self, idx: int, step: Step, attempt: int) -> StepRecord:
        end = time.monotonic() + self.cfg.rejoin_wait_s
        while self._online_count() < self.cfg.min_agents and time.monotonic() < end:
            self._pump(min(0.5, max(0.0, end - time.monotonic())))  # let restarted agents rejoin
        online = self._online_agents()
        if not online:
            raise QuorumError(f"step {idx + 1} ({step.phase}, round {step.round}): no agent online")
        participants = self.strategy.select(idx, step, online, self.cfg.fraction)
        rec = StepRecord(idx, step.round, step.phase, participants, "open", attempt)
        self.store.open_step(rec)
        return rec

    # ----- collecting replies ---------------------------------------------------------------
    def collect(self, rec: StepRecord, step: Step) -> OpenStep:
        """Send tasks to participants without a stored update and wait for their replies."""
        open_step = OpenStep(rec, step)
        self._take_stored(open_step, judged=False)  # a resumed step's: every check
        deadline = time.time() + self.cfg.deadline_s
        config = self.strategy.config.to_dict()  # the same for every task of the step
        payloads = {
            d: self.strategy.configure(step, self.agents[d])
            for d in rec.participants
            if d not in open_step.outcome.replies
        }
        # what several tasks still share is encoded once, and the fields all tasks share
        # (config, run id, deadline) once a step (protocol.wire.reuse_encodings)
        with reuse_encodings():
            payloads, shared, self._knowledge = self._split_shared(step, payloads)
            tasks = {
                d: self._task(
                    open_step, d, deadline, config, payloads=own, shared=shared.get(d, b"")
                )
                for d, own in payloads.items()
            }
            if self._knowledge is not None:  # before the tasks that name it
                self._publish_knowledge(self._knowledge)
            if self.intake is not None:  # before the tasks: their replies may come at once
                self.intake.open(open_step)
            self._send_tasks(open_step, tasks)
        self.endpoint.send(
            self.topics.round,
            RoundDescriptor(
                run_id=self.cfg.run_id,
                round=step.round,
                phase=step.phase,
                deadline=deadline,
                selected=rec.participants,
            ),
            retain=True,
        )
        self._open_step = open_step
        # the steps done before this one give their replies' rows and bytes up here, once the
        # tasks are out (~50 ms at 10,000 agents), not in the previous step's close
        self.store.retire_done_steps()
        try:
            self._wait_for_replies(open_step, deadline + self.cfg.grace_s)
        finally:
            self._open_step = None
        if self.intake is not None:
            # any the polls missed (none: close() polled last), judged by this attempt's workers
            self._take_stored(open_step, judged=True)
        return open_step

    def _send_tasks(self, open_step: OpenStep, tasks: dict[str, Task]) -> None:
        """Send the step's tasks. Those without payloads of their own are one task but for
        their ids (the shared fields are the same objects, ``_task``): their frames are spliced
        from one template per knowledge digest, ~2 us a task instead of ~35 us to build and
        encode an envelope (issue 21), byte-identical to what ``endpoint.send`` would send."""
        templates: dict[bytes, FrameTemplate] = {}
        round_ = open_step.step.round
        spliced: list[tuple[str, bytes]] = []  # handed to the transport at once, after the loop
        for device_id, task in tasks.items():
            open_step.sent(device_id, task)
            topic = self.topics.down(device_id, "task")
            if task.payloads:
                self.endpoint.send(topic, task, round=round_)
                continue
            template = templates.get(task.shared)
            if template is None:
                env = self.endpoint.envelope(task, round=round_)
                template = templates[task.shared] = FrameTemplate.of(env, ("task_id",))
            spliced.append((topic, template.fill(new_message_id(), task.task_id)))
        self.endpoint.send_many_unsigned(spliced, kind=Task.KIND, round=round_)

    def _take_stored(self, open_step: OpenStep, *, judged: bool) -> None:
        """The stored replies of ``open_step``'s step not taken yet (a resumed step's, or
        what the ingest workers stored since the last poll), in device order; ``judged``: as
        :meth:`_take_rows`."""
        taken = open_step.outcome.replies.keys() | open_step.read
        rows = self.store.updates(open_step.rec.idx, skip=taken)
        found = [(device, blob) for device, _msg_id, blob in rows]
        self._take_rows(open_step, found, judged=judged)

    def _take_rows(
        self, open_step: OpenStep, rows: list[tuple[str, bytes]], *, judged: bool
    ) -> None:
        """Stored replies, (device, envelope), validated again: rebuilds per-step rules
        (round 1's dim) in the order they come. ``judged``: stored by this run's ingest
        workers during this attempt (:meth:`ReplyDesk.check`)."""
        step, replies, read = open_step.step, open_step.outcome.replies, open_step.read
        for device_id, blob in rows:
            if device_id in replies or device_id in read:  # stored by this engine, or taken
                continue
            read.add(device_id)
            try:
                body = decode(blob).body
            except ProtocolError as exc:  # its segment damaged since (the store logged why)
                self.log.error("stored reply of %s unreadable: %s", device_id, exc)
                continue
            agent = self.agents.get(device_id)
            if not isinstance(body, Reply) or not agent:
                continue
            try:
                self.desk.check(step, agent, body, judged=judged)
            except ValidationError as exc:  # cannot pass twice differently; never aggregate it
                self.log.warning("stored reply of %s no longer valid: %s", device_id, exc)
                continue
            open_step.replied(device_id, body)

    def _wait_for_replies(self, open_step: OpenStep, end: float) -> None:
        # with ingest workers, look at the store often: their replies do not pass our inbox
        wait = 0.5 if self.intake is None else POLL_S
        while open_step.outstanding:
            remaining = end - time.time()
            if remaining <= 0:
                break
            self._pump(min(remaining, wait))
            if self.intake is not None:
                self._take_polled(open_step, self.intake.poll(open_step))
        if self.intake is not None:  # closed before the deadline's verdict: none slips in
            self._take_polled(open_step, self.intake.close(open_step))
        for d in sorted(open_step.outstanding):
            open_step.fail(d, "deadline")

    def _take_polled(self, open_step: OpenStep, polled: Polled) -> None:
        """Take the replies the ingest workers stored since the last poll (decoded and checked
        while the step is open, so that its close reads none of them again), and count the
        ones they refused as invalid as the engine counts its own."""
        self._take_rows(open_step, polled.stored, judged=True)  # against this very attempt
        for device, reason in polled.refused:
            self._reject("invalid_reply", f"{device}: {reason}")

    def _task(
        self,
        open_step: OpenStep,
        device_id: str,
        deadline: float,
        config: dict[str, Any],
        *,
        payloads: dict[str, Payload],
        shared: bytes,
    ) -> Task:
        rec, step = open_step.rec, open_step.step
        return Task(
            task_id=task_id(self.cfg.run_id, rec.idx, rec.attempt, device_id),
            run_id=self.cfg.run_id,
            round=step.round,
            phase=step.phase,
            deadline=deadline,
            algorithm=self.strategy.name,
            config=config,
            payloads=payloads,
            shared=shared,
        )

    def _split_shared(
        self, step: Step, payloads: dict[str, dict[str, Payload]]
    ) -> tuple[dict[str, dict[str, Payload]], dict[str, bytes], Knowledge | None]:
        """Move the payloads the agents' tasks share into the step's knowledge (``WIRE.md`` §5).

        ``payloads``: each participant's map from the strategy's ``configure``. Returns the
        maps left in the tasks, the knowledge digest of each device whose task names it, and
        the knowledge (None: nothing shared).

        Shared means the *same object* under one name in every map that has the name, in two
        maps at least (strategies hand every agent the one object of their global knowledge),
        and at least ``run.broadcast_min_bytes`` encoded. A task takes ``shared`` only if it
        has every shared name: the agent merges the whole knowledge, and the algorithm must
        see exactly the map ``configure`` returned.
        """
        names = _shared_names(list(payloads.values())) if self.cfg.broadcast else []
        names = [n for n in names if self._big_enough(payloads, n)]
        if not names:
            return payloads, {}, None
        first = next(p for p in payloads.values() if names[0] in p)
        knowledge = Knowledge.of(step.round, {n: first[n] for n in names})
        out, shared = {}, {}
        for device_id, own in payloads.items():
            if all(n in own for n in names):
                out[device_id] = {k: v for k, v in own.items() if k not in knowledge.payloads}
                shared[device_id] = knowledge.digest
            else:
                out[device_id] = own
        return out, shared, knowledge

    def _big_enough(self, payloads: dict[str, dict[str, Payload]], name: str) -> bool:
        if self.cfg.broadcast_min_bytes == 0:
            return True
        payload = next(p[name] for p in payloads.values() if name in p)
        return len(pack_payloads({name: payload})) >= self.cfg.broadcast_min_bytes

    def _publish_knowledge(self, knowledge: Knowledge) -> None:
        """Retained on ``bcast/knowledge`` so that an agent subscribing later gets it too.

        Bulk data is never retained (``WIRE.md`` §2): knowledge too large for one frame goes
        out in chunks to the agents subscribed now, the retained one is cleared (it would name
        an older digest), and the others fetch it.
        """
        topic = self.topics.bcast(Knowledge.KIND)
        self._knowledge_sent = True
        try:
            self.endpoint.send(topic, knowledge, round=knowledge.round, retain=True)
        except LimitError:
            self.endpoint.transport.publish(topic, b"", qos=1, retain=True)
            self.endpoint.send(topic, knowledge, round=knowledge.round)

    def _clear_knowledge(self) -> None:
        """The run is over: its last knowledge must not stay retained for the next run."""
        if self._knowledge_sent:
            with contextlib.suppress(EdgeFLError):
                self.endpoint.transport.publish(
                    self.topics.bcast(Knowledge.KIND), b"", qos=1, retain=True
                )

    def _on_fetch(self, device: str, fetch: Fetch) -> None:
        """An agent missed the step's knowledge (joined late, lost its session): send it."""
        knowledge = self._knowledge
        task = self._task_of(device)
        if knowledge is not None and task is not None and task.shared == fetch.digest:
            topic = self.topics.down(device, Knowledge.KIND)
            self.endpoint.send(topic, knowledge, round=knowledge.round)
            return
        reason = f"no task of {device} in the open step names knowledge {fetch.digest.hex()}"
        self._reject("unknown_knowledge", reason)
        body = ErrorReply(code=UNKNOWN_KNOWLEDGE, reason=reason, ref_id=fetch.digest.hex())
        self.endpoint.send(self.topics.down(device, "error"), body)

    def _pump(self, timeout: float) -> None:
        """Handle what arrived (waiting up to ``timeout`` for the first message).

        Group commit: everything already queued is handled in one transaction, and the acks
        leave only after it commits, so an acknowledged update is durable while a burst of N
        replies costs one fsync instead of N (1000 agents: see benchmarks/bench_coordinator.py).
        """
        if self.health_check is not None:
            self.health_check()
        self._heartbeat()
        batch = take_batch(self.inbox, timeout)
        if not batch:
            return
        with self.store.transaction():
            self.desk.prefetch([env.msg_id for env, _ in batch if isinstance(env.body, Reply)])
            for env, topic in batch:
                self._handle(env, topic)
            updates, self._updates = self._updates, []
            self.store.add_updates(updates)  # one statement a batch, before its acks leave
            registered, self._registered = self._registered, {}
            self.store.upsert_agents(registered)  # one statement a batch, not one a message,
            touched, self._touched = self._touched, {}
            self.store.touch_agents(touched)  # and after them what they said since
        acks, self._acks = self._acks, []
        frames = [(ack_topic, self._ack_frames.unsigned(ack)) for ack_topic, ack in acks]
        self.endpoint.send_many_unsigned(frames, kind=Ack.KIND, round=0)

    def _ack(self, topic: str, ack: Ack) -> None:
        self._acks.append((topic, ack))  # sent by _pump once the batch is committed

    def _handle(self, env: Envelope, topic: str) -> None:
        worker = None if self.intake is None else self.intake.worker_of(topic)
        if worker is not None:
            self._on_worker(env, worker)
            return
        refused = screen(self.topics, env, topic, self.endpoint.trusted(env))
        if refused is not None:
            self._reject(*refused)
            return
        device, body = env.sender, env.body
        if device in self.agents:  # last seen, for `coordinator status`
            online = body.state in ("online", "busy") if isinstance(body, Status) else None
            said = self._touched.get(device)  # the batch's last statement of its state holds
            self._touched[device] = said if online is None else online
        if isinstance(body, Register):
            self._on_register(env, body)
        elif isinstance(body, Status):
            if body.state in ("online", "busy"):
                self.online.add(device)
            else:
                self.online.discard(device)
        elif isinstance(body, Reply):
            self._on_reply(env, body)
        elif isinstance(body, Fetch):
            self._on_fetch(device, body)
        elif isinstance(body, ErrorReply):
            if self._task_of(device, body.task_id) is not None and self._open_step is not None:
                self._open_step.fail(device, f"{body.code}: {body.reason}")
            self.log.warning("agent %s reported %s: %s", device, body.code, body.reason)
        elif isinstance(body, Progress):
            self.log.debug(
                "%s round %d %s: %d/%d loss %.4f",
                device,
                body.round,
                body.phase,
                body.step,
                body.total,
                body.loss,
            )
        else:
            self._reject("unexpected_kind", f"{env.kind} from {device}")

    def _on_worker(self, env: Envelope, worker: str) -> None:
        """An ingest worker came or went. One killed mid-step took the replies it held but had
        not stored: their devices got no ack and keep them in their outboxes, and an agent
        sent its task again answers with the stored reply (same message id, so never stored
        twice). The broker does not hand a dead member's messages to the others."""
        body = env.body
        if not isinstance(body, Status) or env.sender != self.endpoint.sender:
            self._reject("unexpected_kind", f"{env.kind} from {env.sender} as worker {worker}")
            return
        if not self.endpoint.trusted(env) and not is_will(body):
            self._reject("unsigned", f"unsigned {body.state!r} of ingest worker {worker}")
            return
        assert self.intake is not None  # only called with workers
        self.log.info("ingest worker %s: %s", worker, body.state)
        if self.intake.on_status(worker, body) and self._open_step is not None:
            self._resend_tasks(self._open_step)

    def _resend_tasks(self, open_step: OpenStep) -> None:
        """Send their task again to the devices the open step still waits for."""
        waiting = sorted(open_step.outstanding)
        self.log.warning("ingest workers changed: sending %d open tasks again", len(waiting))
        for device_id in waiting:
            task = open_step.tasks[device_id]
            self.endpoint.send(self.topics.down(device_id, "task"), task, round=task.round)

    def _task_of(self, device: str, task_id: str | None = None) -> Task | None:
        """The open step's task for ``device`` (``None`` if none, or if ``task_id`` differs)."""
        task = None if self._open_step is None else self._open_step.tasks.get(device)
        if task is None or (task_id is not None and task.task_id != task_id):
            return None
        return task

    def _on_register(self, env: Envelope, reg: Register) -> None:
        if reg.device_id != env.sender:
            self._reject("sender_mismatch", f"register for {reg.device_id} sent by {env.sender}")
            return
        agent = AgentInfo(reg.device_id, reg)
        try:
            self._admit(agent)
        except AdmissionError as exc:
            self._refuse(env, exc)
            return
        known = reg.device_id in self.agents
        previous = self.agents[reg.device_id].register.session if known else ""
        self.refused.pop(reg.device_id, None)
        self.agents[reg.device_id] = agent
        self.online.add(reg.device_id)
        self._registered[reg.device_id] = env.wire or encode(env)  # stored with the batch
        self._touched.pop(reg.device_id, None)  # what the batch said before is older
        if not known:
            self._log_registration(reg)
        task = self._task_of(reg.device_id)
        # A restarted agent (or one whose broker session was lost) lost its task: send it
        # again. The same session registering again still has it queued: a resend made it
        # answer twice (issue 20 §5).
        if task is not None and not (reg.session and reg.session == previous):
            self.endpoint.send(self.topics.down(reg.device_id, "task"), task, round=task.round)

    def _log_registration(self, reg: Register) -> None:
        """One line per new agent up to ``REGISTRATIONS_LOGGED``, then one per thousand: at
        10,000 agents a line each was 10,000 lines and a third of registration's time."""
        count = len(self.agents)
        level = logging.INFO if count <= REGISTRATIONS_LOGGED else logging.DEBUG
        if self.log.isEnabledFor(level):
            samples = sum(reg.class_counts.values())
            line = "agent %s registered: %s, %d params, %d samples"
            self.log.log(level, line, reg.device_id, reg.arch, reg.num_params, samples)
        if count > REGISTRATIONS_LOGGED and count % 1000 == 0:
            self.log.info("%d agents registered", count)

    def _admit(self, agent: AgentInfo) -> None:
        """The engine's own checks, then the strategy's, against the agents admitted so far."""
        reg = agent.register
        if reg.algorithm != self.strategy.name:
            raise AdmissionError(
                agent.device_id, f"it runs {reg.algorithm}; this run is {self.strategy.name}"
            )
        if reg.num_classes != self.cfg.num_classes:
            raise AdmissionError(
                agent.device_id,
                f"it has {reg.num_classes} classes; this run has {self.cfg.num_classes}",
            )
        self._admit_class_names(agent)
        declared = self.strategy.declared_feature_dim()
        if declared and reg.feature_dim and reg.feature_dim != declared:
            # the run declares its prototypes' size: refuse now, not at the first reply
            raise AdmissionError(
                agent.device_id,
                f"its features have {reg.feature_dim} dimensions; this run's have {declared} "
                f"(--feature-dim {declared})",
            )
        if type(self.strategy).admit is Strategy.admit:
            return  # admits everyone: the fleet list cost O(N) a registration, O(N^2) a fleet
        fleet = [
            a
            for d, a in sorted(self.agents.items())
            if d != agent.device_id and d not in self.refused
        ]
        self.strategy.admit(agent, fleet)

    def _admit_class_names(self, agent: AgentInfo) -> None:
        """Same class count is not enough: index 0 must mean the same class on every device."""
        classes = self.cfg.classes
        names = agent.register.class_names
        if not classes or list(classes) == names:
            return
        if not names:
            raise AdmissionError(
                agent.device_id,
                "it names no classes; this run's classes are named "
                "(run it with --classes or let it adopt the coordinator's)",
            )
        i = next(i for i, (a, b) in enumerate(zip(names, classes, strict=True)) if a != b)
        raise AdmissionError(
            agent.device_id,
            f"class {i} is {names[i]!r} on the device, {classes[i]!r} in the federation",
        )

    def _refuse(self, env: Envelope, exc: AdmissionError) -> None:
        """Tell the agent why it may not join: without an answer it would wait forever."""
        self._reject("refused_agent", str(exc))
        self.refused[exc.device_id] = exc.reason
        self.online.discard(exc.device_id)  # a re-registration that is refused now: never select
        body = ErrorReply(code=REFUSED, reason=exc.reason, ref_id=env.msg_id)
        self.endpoint.send(self.topics.down(exc.device_id, "error"), body)

    def _on_reply(self, env: Envelope, reply: Reply) -> None:
        device, open_step = env.sender, self._open_step
        task = self._task_of(device)
        verdict = self.desk.judge(
            env,
            reply,
            None if open_step is None else open_step.step,
            None if task is None else task.task_id,
            self.agents.get(device),
        )
        if verdict.reject is not None:
            self._reject(*verdict.reject)
        if open_step is not None and verdict.fail is not None:
            open_step.fail(device, verdict.fail)
        if verdict.ack is None:  # the resend passes the endpoint's filter via _on_duplicate
            self.deferred += 1
            self.log.info("reply %s from %s deferred: no step is open", reply.task_id, device)
            return
        if verdict.store and open_step is not None:
            # the frame as received (already validated): encoding it again cost 5-10 % per reply
            blob = env.wire or encode(env)
            self._updates.append((open_step.rec.idx, device, env.msg_id, reply.task_id, blob))
            self.desk.mark_stored(env.msg_id)
            open_step.replied(device, reply)
        self._ack(self.topics.down(device, "ack"), verdict.ack)  # sent after the commit

    def _check_reply(self, step: Step, agent: AgentInfo, reply: Reply) -> None:
        """Raise :class:`ValidationError` for a reply that cannot be aggregated."""
        self.desk.check(step, agent, reply)

    def _reject(self, reason: str, detail: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        self.log.warning("rejected (%s): %s", reason, detail)

    # ----- closing a step -------------------------------------------------------------------
    def _finish(self, open_step: OpenStep, started: float, traffic0: dict[str, int]) -> None:
        rec, step, outcome = open_step.rec, open_step.step, open_step.outcome
        ordered = [(self.agents[d], outcome.replies[d]) for d in sorted(outcome.replies)]
        try:
            agg = self._aggregate(rec.idx, step, ordered)
        except AggregationError as exc:
            self._fail_aggregation(open_step, exc, ordered, started, traffic0)
            return
        record = self._metrics_record(open_step, ordered, agg, started, traffic0)
        line = json.dumps(record)  # once: 10,000 agents' figures take 50 ms to encode
        self.store.complete_step(rec.idx, "done", self.strategy.state_dict(), line)
        append_line(self.metrics_path, line)
        self.log.info(
            "step %d/%d %s round %d: %d/%d replies, local acc %s, global acc %s, %d bytes",
            rec.idx + 1,
            len(self.plan),
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
        """The strategy's handler for the step's phase (none: nothing to fold), then
        server-side training."""
        handler = self.strategy.aggregators().get(step.phase)
        agg = {} if handler is None else handler(step, ordered)
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

    def _metrics_record(
        self,
        open_step: OpenStep,
        ordered: list[tuple[AgentInfo, Reply]],
        agg: dict[str, float],
        started: float,
        traffic0: dict[str, int],
    ) -> dict[str, Any]:
        now = self.endpoint.traffic.snapshot()
        traffic = {k: v - traffic0.get(k, 0) for k, v in now.items() if v - traffic0.get(k, 0)}
        if self.intake is not None:  # the replies and acks the ingest workers moved
            for key, n in self.store.worker_traffic(open_step.rec.idx).items():
                traffic[key] = traffic.get(key, 0) + n
        # progress heartbeats are the runtime's, not the algorithm's: kept out of its byte
        # figures (they depend on the progress interval and on training speed), counted apart
        progress = {k: traffic.pop(k) for k in list(traffic) if k.endswith(".progress")}
        record = step_record(
            open_step.step,
            open_step.rec.participants,
            open_step.outcome.failed,
            ordered,
            agg,
            started,
            traffic,
        )
        record["bytes_progress"] = sum(progress.values())
        return record


def _shared_names(maps: list[dict[str, Payload]]) -> list[str]:
    """Names whose value is one object in every map that has it, and in two maps at least."""
    first: dict[str, Payload] = {}
    count: Counter[str] = Counter()
    differ: set[str] = set()
    for payloads in maps:
        for name, value in payloads.items():
            if first.setdefault(name, value) is not value:
                differ.add(name)
            count[name] += 1
    return [n for n in first if n not in differ and count[n] >= 2]


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
