"""The round leader's side of ingest workers (``run.ingest_workers`` > 0).

The workers (``coordinator/engine/ingest_worker.py``) take the agents' replies through an MQTT
shared
subscription, judge each with the engine's :class:`~coordinator.engine.replies.ReplyDesk`, store it
in
the run's SQLite store and acknowledge it. The leader (the engine) opens and closes steps as
before; it tells the workers which step is open through the store (:meth:`Store.set_intake`)
and takes what they stored by polling the store (every ``POLL_S``, while the step is open). A
chunked reply never reaches a worker: its chunks travel on the reply's chunk topic, which the
leader subscribes to itself. Design and figures: ``docs/howto/run-at-scale.md``.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import NamedTuple

from coordinator.engine.step import OpenStep, QuorumError
from coordinator.store.database import Store
from protocol.contract.messages import Status
from protocol.contract.topics import CHUNKS, Topics

__all__ = [
    "GROUP",
    "LEADER_UP_KINDS",
    "POLL_S",
    "Polled",
    "WorkerIntake",
    "new_share_group",
    "share_group",
]

#: What the leader still takes from the agents itself: everything but ``reply``.
LEADER_UP_KINDS = ("register", "error", "fetch", "chunk_req")
#: How often the leader looks for stored replies while a step is open (an indexed query).
POLL_S = 0.05
#: The prefix of a run's share group (its workers' ``$share/{group}/...`` subscription).
GROUP = "edgefl-ingest"
SHARE_GROUP_KEY = "ingest_group"  # meta key of the run's share group


def new_share_group(store: Store) -> str:
    """Give a new run its share group: ``edgefl-ingest-`` and 128 random bits, kept in the
    run's store, where its workers read it. Unguessable because Mosquitto lets any client
    with read access to nothing of it *join* a share group: the broker then hands that member
    its turn of the replies and its ACL refuses to deliver them, so they are lost (measured on
    Mosquitto 2.0.11 with the provisioned ACL: a device in the group took 3 of 6 replies,
    and none arrived anywhere; ``tests/coordinator/ops/test_provision_broker.py``)."""
    group = f"{GROUP}-{secrets.token_hex(16)}"
    store.set_meta(SHARE_GROUP_KEY, group)
    return group


def share_group(store: Store) -> str:
    """The run's share group (a run stored before groups were random: the fixed name)."""
    group = store.get_meta(SHARE_GROUP_KEY)
    return group if isinstance(group, str) else GROUP


class Polled(NamedTuple):
    """What the workers did since the last poll."""

    stored: list[tuple[str, bytes]]  # (device, envelope as received), in storing order
    refused: list[tuple[str, str]]  # (device, reason)


class WorkerIntake:
    """Which workers are online, and which replies of the open step they have stored: the
    :class:`~coordinator.engine.intake.ReplySource` of a run with ingest workers."""

    poll_s = POLL_S  # look at the store often: the workers' replies do not pass the inbox

    def __init__(self, count: int, store: Store, topics: Topics) -> None:
        self.count = count  # workers the run waits for before its first step
        self.store = store
        self.online: set[str] = set()
        self._prefix = topics.ingest("x")[:-1]
        self._cursor = 0  # rowid of the last update of the open step seen
        self._refusals: set[str] = set()

    def subscriptions(self, base: str) -> list[str]:
        """The leader's filters: agents' non-reply messages, the chunks of every message an
        agent sends (a chunked reply's included: the workers' shared ``up/reply`` does not
        match them, so the leader reassembles it without a relay), presence, and the
        workers'."""
        ups = [f"{base}/dev/+/up/{kind}" for kind in LEADER_UP_KINDS]
        chunks = f"{base}/dev/+/up/+/{CHUNKS}"
        return [*ups, chunks, f"{base}/dev/+/status", f"{base}/dev/+/progress", f"{self._prefix}+"]

    def leader_topics(self, base: str) -> list[str]:
        """A chunked reply: its chunks come to the leader, which reassembles it."""
        return [f"{base}/dev/+/up/reply"]

    def wait_ready(
        self, pump: Callable[[float], None], timeout: float, log: logging.Logger
    ) -> None:
        """Wait until ``run.ingest_workers`` workers are online: a reply published while no
        member holds the shared subscription is dropped by the broker."""
        end = time.monotonic() + timeout
        while len(self.online) < self.count:
            if time.monotonic() > end:
                raise QuorumError(
                    f"only {len(self.online)} of {self.count} ingest workers "
                    f"online within {timeout:.0f} s"
                )
            pump(min(0.5, max(0.0, end - time.monotonic())))
        log.info("%d ingest workers online", len(self.online))

    def worker_of(self, topic: str) -> str | None:
        """The worker id of a ``coord/ingest/{worker}`` topic, else ``None``."""
        return topic[len(self._prefix) :] if topic.startswith(self._prefix) else None

    def on_status(self, worker: str, status: Status) -> bool:
        """Record a worker's presence; ``True`` when its replies in flight may be lost (it
        went offline) or none could be taken (the first worker back after none was online)."""
        was = bool(self.online)
        if status.state == "online":
            self.online.add(worker)
            return not was
        gone = worker in self.online
        self.online.discard(worker)
        return gone

    def open(self, open_step: OpenStep) -> None:
        """Let the workers store replies of ``open_step`` (before its tasks leave)."""
        rec, step = open_step.rec, open_step.step
        self._cursor, self._refusals = 0, set()
        self.store.set_intake(
            {
                "step": rec.idx,
                "attempt": rec.attempt,
                "round": step.round,
                "phase": step.phase,
                "participation": step.participation,
            }
        )

    def poll(self, open_step: OpenStep) -> Polled:
        """Stop waiting for devices whose reply a worker stored or refused as invalid; returns
        the replies stored since the last poll, (device, envelope), for the engine to take
        while the step is open (not all at its close), and the new refusals,
        (device, reason), for the engine to count as its own."""
        idx = open_step.rec.idx
        rows = []
        for rowid, device, envelope in self.store.stored_since(idx, self._cursor):
            self._cursor = rowid
            open_step.stored(device)
            rows.append((device, envelope))
        refused = []
        for device, reason in self.store.refusals(idx, open_step.rec.attempt):
            if device not in self._refusals:
                self._refusals.add(device)
                open_step.fail(device, reason)
                refused.append((device, reason))
        return Polled(rows, refused)

    def close(self, open_step: OpenStep) -> Polled:
        """No more replies for ``open_step``; then take note of the last ones stored."""
        self.store.set_intake(None)
        return self.poll(open_step)

    def unread(self, open_step: OpenStep) -> list[tuple[str, bytes]]:
        """Any stored reply of the closed ``open_step`` the polls missed (none: :meth:`close`
        polled last)."""
        return open_step.unread(self.store)

    def traffic(self, idx: int) -> dict[str, int]:
        """The bytes of the replies and acks the workers moved for step ``idx``."""
        return self.store.worker_traffic(idx)
