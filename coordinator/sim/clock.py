"""A simulated clock for profiled simulations (``coordinator simulate --clock simulated``).

Under the real clock a device profile (:mod:`coordinator.sim.profile`) holds each reply back in
wall-clock time, so a fleet of devices ten times slower takes ten times as long to simulate.
Under this clock nothing is slept: each reply is scheduled at its simulated arrival,

    its task's simulated dispatch + the downlink latency
    + the compute time measured on this host x the device's speed
    + the uplink latency and upload time,

a device computing one task at a time (a task that arrives while it still computes an earlier
one starts when that one ends). A discrete-event loop in the engine's wait for a step's replies
(:meth:`SimulatedClock.take`) moves simulated time only while the simulation is quiescent: no
device holds a task it has not answered yet, no released reply is on its way to the
coordinator, and no message has moved for ``settle_s`` of real time. It then jumps to the
earliest scheduled reply (or to the end of the wait, a deadline, when it comes first), releases
it and waits for the engine to take it. Step deadlines (fixed and adaptive), reply times and the
metrics' ``time`` and ``duration_s`` are read on this clock.

Limits: the coordinator's own work (aggregation, persistence) takes no simulated time; a
device's compute time is measured in real time on a shared host, so agents that train at once
inflate each other's (``compute_s`` fixes it instead, for a reproducible timeline); messages
other than tasks and replies (registrations, acks, broadcast knowledge) are delivered at once;
a device that holds a task and shows no sign of life for ``stall_s`` of real time (it ignored a
task: a repeat of one whose reply was already acknowledged) is taken as idle, with a warning.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from coordinator.engine.clock import Clock
from coordinator.engine.replies import take_batch
from protocol.contract.topics import Topics
from protocol.transport.base import Handler, Transport, WrappedTransport

__all__ = ["SETTLE_S", "STALL_S", "SimulatedClock"]

log = logging.getLogger("edgefl.sim.clock")

T = TypeVar("T")

# Real time without a message anywhere after which the simulation counts as quiescent: covers
# what is not counted exactly (an agent's status or progress message, an ack on its way).
SETTLE_S = 0.05
STALL_S = 120.0  # a device holding a task this long without a sign of life is taken as idle


class SimulatedClock(Clock):
    """Simulated time: starts at the real time of its creation and moves only by the
    discrete-event loop of :meth:`take`."""

    def __init__(
        self,
        *,
        settle_s: float = SETTLE_S,
        stall_s: float = STALL_S,
        compute_s: float | None = None,
    ) -> None:
        """``compute_s``: every task takes this long on the host, whatever it measured (a
        timeline independent of the host's load); ``None``: the measured time."""
        self.settle_s, self.stall_s, self.compute_s = settle_s, stall_s, compute_s
        self._epoch = time.time()
        self._now = 0.0
        self._lock = threading.Lock()
        # (simulated time, order, device, frame, its delivery), earliest first
        self._events: list[tuple[float, int, str, bytes, Callable[[], None]]] = []
        self._waiting: set[tuple[str, bytes]] = set()  # (device, frame) of the events
        self._order = itertools.count()
        self._busy: dict[str, float] = {}  # device -> real time of its last sign of life
        self._in_flight = 0  # released reply frames the coordinator has not taken yet
        self._moved = time.monotonic()  # real time of the last message anywhere
        self._settled_at: float | None = None  # _moved when last found quiescent

    # ----- the engine's side ----------------------------------------------------------------
    def time(self) -> float:
        return self._epoch + self._now

    def monotonic(self) -> float:
        return self._now

    def take(self, inbox: queue.Queue[T], timeout: float, *, for_replies: bool = False) -> list[T]:
        """Messages as :meth:`Clock.take`; a wait for replies runs the discrete-event loop:
        while nothing comes, once the simulation is quiescent, simulated time jumps to the next
        scheduled reply within ``timeout`` (released, then taken from ``inbox``), or to the
        end of ``timeout`` when none is due by then."""
        if not for_replies:
            return take_batch(inbox, timeout)
        end = self._now + timeout
        while True:
            # quiescent already and nothing moved since: no need to wait for it to settle again
            settled = self._settled_at == self._moved
            batch = take_batch(inbox, 0.0 if settled else self.settle_s)
            if batch:
                return batch
            if not self._quiescent():
                continue
            self._settled_at = self._moved
            if self._release_due(end) is None:
                self._now = max(self._now, end)
                return []

    def _quiescent(self) -> bool:
        now = time.monotonic()
        with self._lock:
            if now - self._moved < self.settle_s:
                return False
            for device, seen in list(self._busy.items()):
                if now - seen >= self.stall_s:
                    log.warning(
                        "%s held its task %.0f s without a reply: taken as idle", device, now - seen
                    )
                    del self._busy[device]
            if self._in_flight and now - self._moved >= self.stall_s:
                log.warning(
                    "%d released reply frames never reached the coordinator", self._in_flight
                )
                self._in_flight = 0
            return not self._busy and not self._in_flight

    def _release_due(self, end: float) -> float | None:
        """Move to the earliest scheduled delivery if it is due by ``end`` and release every
        frame due then; its time (``None``: none is due by ``end``)."""
        with self._lock:
            if not self._events or self._events[0][0] > end:
                return None
            due = self._events[0][0]
            ready = []
            while self._events and self._events[0][0] == due:
                _at, _order, device, frame, publish = heapq.heappop(self._events)
                self._waiting.discard((device, frame))
                ready.append(publish)
            self._now = max(self._now, due)
            self._in_flight += len(ready)
            self._moved = time.monotonic()
        for publish in ready:  # outside the lock: a memory transport delivers synchronously
            publish()
        return due

    # ----- the devices' side ----------------------------------------------------------------
    def hold(self, device: str, at: float, payload: bytes, publish: Callable[[], None]) -> None:
        """Deliver ``device``'s reply frame ``payload`` by calling ``publish`` at simulated time
        ``at``; the device no longer computes. The same frame already waiting (a resend) is not
        scheduled twice."""
        with self._lock:
            self._moved = time.monotonic()
            self._busy.pop(device, None)
            if (device, payload) in self._waiting:
                return
            self._waiting.add((device, payload))
            heapq.heappush(self._events, (at, next(self._order), device, payload, publish))

    def idle(self, device: str) -> None:
        """``device`` answered its task with nothing to deliver (its reply was dropped)."""
        with self._lock:
            self._moved = time.monotonic()
            self._busy.pop(device, None)

    def moved(self, device: str | None = None) -> None:
        """A message moved (from or to ``device``: a sign of life while it computes)."""
        with self._lock:
            self._moved = time.monotonic()
            if device is not None and device in self._busy:
                self._busy[device] = self._moved

    def watch(self, coordinator: Transport, topics: Topics) -> Transport:
        """The coordinator's transport, telling this clock which device got a task (it computes
        until it answers) and when a released reply reached the coordinator."""
        return _Watched(coordinator, topics, self)

    def _tasked(self, device: str) -> None:
        with self._lock:
            self._moved = time.monotonic()
            self._busy[device] = self._moved

    def _delivered(self) -> None:
        with self._lock:
            self._moved = time.monotonic()
            self._in_flight = max(0, self._in_flight - 1)


class _Watched(WrappedTransport):
    """The coordinator's transport, as :meth:`SimulatedClock.watch` describes."""

    def __init__(self, inner: Transport, topics: Topics, clock: SimulatedClock) -> None:
        super().__init__(inner)
        self.topics, self.clock = topics, clock

    def _device_kind(self, topic: str) -> tuple[str, str, str] | None:
        """(device, up|down, kind) of a device's message or chunk topic, else ``None``."""
        parts = (self.topics.message_topic(topic) or topic).split("/")
        base = len(self.topics.base.split("/"))
        if len(parts) != base + 4 or parts[base] != "dev":
            return None
        return parts[base + 1], parts[base + 2], parts[base + 3]

    def _sent(self, topic: str) -> None:
        where = self._device_kind(topic)
        if where is not None and where[1:] == ("down", "task"):
            self.clock._tasked(where[0])
        else:
            self.clock.moved()

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        self._sent(topic)  # before it can arrive: the device computes from now on
        self.inner.publish(topic, payload, qos=qos, retain=retain)

    def publish_many(self, messages: Sequence[tuple[str, bytes]], *, qos: int = 1) -> None:
        for topic, _ in messages:
            self._sent(topic)
        self.inner.publish_many(messages, qos=qos)

    def subscribe(self, topic_filter: str, handler: Handler, qos: int = 1) -> None:
        def watched(topic: str, payload: bytes) -> None:
            self.clock.moved()
            handler(topic, payload)  # into the engine's inbox before the frame counts as taken
            where = self._device_kind(topic)
            if where is not None and where[1:] == ("up", "reply"):
                self.clock._delivered()

        self.inner.subscribe(topic_filter, watched, qos)
