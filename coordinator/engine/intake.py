"""The leader's one reply path. Replies reach the open step two ways: through the leader's
inbox, judged here as they come (:class:`Collector`), or stored by someone else and read back
(a resumed step's, the ingest workers'). A :class:`ReplySource` says which replies go where:
:class:`InProcessIntake` (every reply comes to the leader) or the ingest workers'
:class:`~coordinator.engine.ingest.WorkerIntake`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Protocol

from coordinator.config import RunConfig
from coordinator.engine.ingest import Polled, WorkerIntake
from coordinator.engine.observer import NoObserver, RunObserver
from coordinator.engine.replies import AckFrames, ReplyDesk
from coordinator.engine.step import OpenStep
from coordinator.store.database import Store
from coordinator.strategies import AgentInfo
from protocol.contract.codec import Envelope, decode, encode
from protocol.contract.messages import Ack, Reply, Status
from protocol.contract.topics import Topics
from protocol.errors import ProtocolError, ValidationError
from protocol.transport.endpoint import Endpoint

__all__ = ["Collector", "InProcessIntake", "ReplySource", "reply_source"]


class ReplySource(Protocol):
    """Where the agents' replies go, and how the leader learns of those it does not receive."""

    poll_s: float  # how long the leader waits for messages before polling again

    def subscriptions(self, base: str) -> list[str]:
        """The leader's topic filters under ``base``."""

    def leader_topics(self, base: str) -> list[str]:
        """Topics the endpoint delivers to the leader though it is not subscribed to them."""

    def worker_of(self, topic: str) -> str | None:
        """The ingest worker whose presence ``topic`` carries (``None``: not a worker's)."""

    def on_status(self, worker: str, status: Status) -> bool:
        """Record a worker's presence; ``True``: the open step's tasks must be sent again."""

    def wait_ready(
        self, pump: Callable[[float], None], timeout: float, log: logging.Logger
    ) -> None:
        """Handle messages (``pump``) until replies can be taken; raise ``QuorumError``."""

    def open(self, open_step: OpenStep) -> None:
        """Replies of ``open_step`` may come (called before its tasks leave)."""

    def poll(self, open_step: OpenStep) -> Polled:
        """The replies stored and refused elsewhere since the last poll."""

    def close(self, open_step: OpenStep) -> Polled:
        """No more replies for ``open_step``; the last ones stored and refused elsewhere."""

    def unread(self, open_step: OpenStep) -> list[tuple[str, bytes]]:
        """Replies of the closed ``open_step`` stored elsewhere and not taken yet."""

    def traffic(self, idx: int) -> dict[str, int]:
        """Bytes moved elsewhere for step ``idx`` (replies, acks), by traffic key."""


class InProcessIntake:
    """Every reply comes to the leader's inbox: nothing is stored elsewhere."""

    poll_s = 0.5

    def subscriptions(self, base: str) -> list[str]:
        """Everything the agents send."""
        return [f"{base}/dev/+/up/#", f"{base}/dev/+/status", f"{base}/dev/+/progress"]

    def leader_topics(self, base: str) -> list[str]:
        """None: the leader subscribes to every agent topic."""
        return []

    def worker_of(self, topic: str) -> str | None:
        """No topic is a worker's."""
        return None

    def on_status(self, worker: str, status: Status) -> bool:
        """No workers: never called."""
        return False

    def wait_ready(
        self, pump: Callable[[float], None], timeout: float, log: logging.Logger
    ) -> None:
        """Ready at once."""

    def open(self, open_step: OpenStep) -> None:
        """Nothing to tell anyone."""

    def poll(self, open_step: OpenStep) -> Polled:
        """Nothing stored elsewhere."""
        return Polled([], [])

    def close(self, open_step: OpenStep) -> Polled:
        """Nothing stored elsewhere."""
        return Polled([], [])

    def unread(self, open_step: OpenStep) -> list[tuple[str, bytes]]:
        """Nothing stored elsewhere."""
        return []

    def traffic(self, idx: int) -> dict[str, int]:
        """No bytes moved elsewhere."""
        return {}


def reply_source(cfg: RunConfig, store: Store, topics: Topics) -> ReplySource:
    """The run's reply source: ingest workers when ``run.ingest_workers`` > 0."""
    if cfg.ingest_workers:
        return WorkerIntake(cfg.ingest_workers, store, topics)
    return InProcessIntake()


class Collector:
    """Takes replies into the open step: each reply reaching the leader is judged here (stored
    with its batch, acknowledged after the commit); stored ones are read back and checked."""

    def __init__(
        self,
        desk: ReplyDesk,
        store: Store,
        endpoint: Endpoint,
        topics: Topics,
        agents: Mapping[str, AgentInfo],
        *,
        log: logging.Logger,
        reject: Callable[[str, str], None],
        observer: RunObserver | None = None,
    ) -> None:
        self.desk = desk
        self.store = store
        self.endpoint = endpoint
        self.topics = topics
        self.agents = agents  # the admitted agents (read only)
        self.log = log
        self.reject = reject  # counts and logs a message that is not acted on
        self.observer = observer or NoObserver()  # told of the replies taken, a batch at once
        self.deferred = 0  # replies that arrived while no step was open (left unacknowledged)
        self.deferred_from: set[str] = set()  # their devices (buffered mode sends tasks again)
        self._updates: list[tuple[int, str, str, str, bytes]] = []  # the batch's accepted replies
        self._acks: list[tuple[str, Ack]] = []  # acks waiting for their batch to commit
        self._stored = 0  # replies of the batch stored, told to the observer once it commits
        self._ack_frames = AckFrames(endpoint)

    def on_reply(self, env: Envelope, reply: Reply, open_step: OpenStep | None) -> None:
        """Judge a reply that reached the leader against ``open_step`` (``None``: none open)."""
        device = env.sender
        task = None if open_step is None else open_step.task_of(device)
        step = None if open_step is None else open_step.step
        if open_step is not None and task is not None:  # buffered: the round of an older task
            step = open_step.step_for(task.round)
        verdict = self.desk.judge(
            env,
            reply,
            step,
            None if task is None else task.task_id,
            self.agents.get(device),
            stale=None if open_step is None else open_step.stale_reason(device, reply.task_id),
        )
        if verdict.reject is not None and verdict.reject[0] == "stale" and open_step is not None:
            open_step.stale_refused.append(device)
        if verdict.reject is not None:
            self.reject(*verdict.reject)
            if open_step is not None and verdict.fail is None:
                open_step.note(device, f"refused reply: {verdict.reject[1]}")
        if open_step is not None and verdict.fail is not None:
            open_step.fail(device, verdict.fail)
        if verdict.ack is None:  # the resend passes the endpoint's filter: see Coordinator.start
            self.deferred += 1
            self.deferred_from.add(device)
            self.log.info("reply %s from %s deferred: no step is open", reply.task_id, device)
            return
        if verdict.store and open_step is not None:
            # the frame as received (already validated): encoding it again cost 5-10 % per reply
            blob = env.wire or encode(env)
            self._updates.append((open_step.rec.idx, device, env.msg_id, reply.task_id, blob))
            self.desk.mark_stored(env.msg_id)
            open_step.replied(device, reply)
        self._acks.append((self.topics.down(device, "ack"), verdict.ack))  # sent after the commit

    def flush(self) -> None:
        """Store the batch's accepted replies, in the batch's transaction (before its acks)."""
        updates, self._updates = self._updates, []
        self.store.add_updates(updates)  # one statement a batch
        self._stored += len(updates)

    def send_acks(self) -> None:
        """Acknowledge the batch's replies, once it is committed."""
        acks, self._acks = self._acks, []
        if self._stored:
            self.observer.replies_accepted(self._stored)
            self._stored = 0
        frames = [(ack_topic, self._ack_frames.unsigned(ack)) for ack_topic, ack in acks]
        self.endpoint.send_many_unsigned(frames, kind=Ack.KIND, round=0)

    def take_polled(self, open_step: OpenStep, polled: Polled) -> None:
        """Take the replies stored elsewhere since the last poll (decoded and checked while
        the step is open, so that its close reads none of them again), and count the ones
        refused there as invalid as the leader counts its own."""
        self.take_rows(open_step, polled.stored, worker_checked=True)  # against this very attempt
        for device, reason in polled.refused:
            self.reject("invalid_reply", f"{device}: {reason}")

    def take_stored(self, open_step: OpenStep, *, worker_checked: bool) -> None:
        """The stored replies of ``open_step`` not taken yet (a resumed step's, or what the
        ingest workers stored since the last poll), in device order; ``worker_checked``: as
        :meth:`take_rows`."""
        self.take_rows(open_step, open_step.unread(self.store), worker_checked=worker_checked)

    def take_rows(
        self, open_step: OpenStep, rows: list[tuple[str, bytes]], *, worker_checked: bool
    ) -> None:
        """Stored replies, (device, envelope), validated again, in the order they come.
        ``worker_checked``: stored by this run's ingest workers during this attempt
        (:meth:`ReplyDesk.check`)."""
        replies, read = open_step.outcome.replies, open_step.read
        taken = 0
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
                task_step = open_step.step_for(body.round)  # buffered: an earlier round's reply
                self.desk.check(task_step, agent, body, worker_checked=worker_checked)
            except ValidationError as exc:  # cannot pass twice differently; never aggregate it
                self.log.warning("stored reply of %s no longer valid: %s", device_id, exc)
                continue
            open_step.replied(device_id, body)
            taken += 1
        if taken:
            self.observer.replies_accepted(taken)
