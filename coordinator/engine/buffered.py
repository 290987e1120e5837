"""Buffered (semi-asynchronous, FedBuff-style) training rounds: tasks that outlive their step.

In ``run.mode = "buffered"`` a training step is one global version. It closes as soon as
``run.buffer_size`` replies are stored (or at its deadline with at least ``run.min_replies``);
the devices whose replies it folded get a task of the next version when it opens, the others
keep working on the task they hold, and their reply is folded into a later step, weighted by
its staleness (:mod:`coordinator.engine.staleness`). A task more than ``run.max_staleness``
versions old is replaced by a fresh one when a step opens; the reply to it is then refused as
``stale``, with that reason in its ack.

The tasks in flight are durable (meta ``buffered_tasks``, written with each step's close in
the same transaction as its global state), so a coordinator killed mid-run takes the replies
to them after its restart, and every stored reply is folded exactly once: by the step that
stored it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from coordinator.config import RunConfig
from coordinator.engine.clock import Clock
from coordinator.engine.intake import Collector
from coordinator.engine.staleness import StalenessRule
from coordinator.engine.step import OpenStep
from coordinator.store.database import Store
from coordinator.strategies import Step, Strategy
from protocol.contract.messages import Task

__all__ = ["TASKS_KEY", "TaskBuffer", "task_buffer"]

TASKS_KEY = "buffered_tasks"  # meta: device -> [task id, round, phase] of its task in flight


def task_buffer(cfg: RunConfig, store: Store, clock: Clock | None = None) -> TaskBuffer:
    """The run's task buffer (in a synchronous run one that does nothing). A strategy that
    cannot take replies of older rounds never gets here: its config refuses buffered mode
    (:func:`coordinator.strategies.check_mode`)."""
    if cfg.mode != "buffered":
        return TaskBuffer(cfg.staleness_rule(), 0, store)
    return TaskBuffer(
        cfg.staleness_rule(), cfg.buffer_size, store, resend_after_s=cfg.deadline_s, clock=clock
    )


class TaskBuffer:
    """The tasks in flight across steps, and the staleness of the replies to them."""

    def __init__(
        self,
        rule: StalenessRule,
        buffer_size: int,
        store: Store,
        *,
        resend_after_s: float = math.inf,
        clock: Clock | None = None,
    ) -> None:
        self.rule = rule
        self.buffer_size = buffer_size  # 0: a synchronous run, nothing is buffered
        self.store = store
        # device -> its task in flight; after a restart only its id, round and phase are known
        # (the payloads of an older version are gone): such a task is rebuilt with the current
        # payloads under its own id, so that an agent holding it answers with its reply
        stored = store.get_meta(TASKS_KEY) if buffer_size else None
        self.tasks: dict[str, Task | tuple[str, int, str]] = {
            d: (str(t[0]), int(t[1]), str(t[2])) for d, t in (stored or {}).items()
        }
        self.resend: set[str] = set(self.tasks)  # restored: every one goes out again once
        # a task in flight longer than a step's deadline (run.deadline_s) goes out again when
        # a step opens: its reply may have been lost, and its device would sit idle until the
        # task grew too stale. An agent answers a task it did with its stored reply (the same
        # message id), so a resend never trains twice nor counts twice.
        self.resend_after_s = resend_after_s
        self.sent_at: dict[str, float] = {}  # task id -> when it (last) went out, as seen here
        self.clock = clock or Clock()

    def applies(self, step: Step) -> bool:
        """Training rounds of a buffered run are buffered; the final phases stay synchronous."""
        return self.buffer_size > 0 and step.phase == "train"

    def participants(self, step: Step, selected: list[str]) -> list[str]:
        """The selected devices, and in a buffered step those still working on a task of an
        earlier one."""
        return sorted(set(selected) | set(self.tasks)) if self.applies(step) else selected

    def open(
        self, open_step: OpenStep, collector: Collector
    ) -> tuple[dict[str, Task], dict[str, tuple[str, int]]]:
        """Put the tasks in flight into ``open_step``: returns those that go out again (a
        reply deferred while no step was open, or a restart) and the (id, round) of the
        restored ones, which :meth:`rebuild` makes from the step's tasks. A task too stale is
        dropped (its device gets a fresh one) and its reply will be refused with the reason."""
        self.resend |= collector.deferred_from
        collector.deferred_from.clear()
        if not self.applies(open_step.step):
            return {}, {}
        open_step.buffer_size = self.buffer_size
        open_step.max_staleness = self.rule.max_staleness
        step, again, restored = open_step.step, {}, {}
        now = self.clock.monotonic()
        for device, task in sorted(self.tasks.items()):
            task_id, round_, phase = _ids(task)
            if device in open_step.outcome.replies or device in open_step.gone:
                continue
            if phase != step.phase or device not in open_step.rec.participants:
                continue
            why = self.rule.refusal(step.round - round_, round_, step.round)
            if why is not None:
                open_step.stale[device] = (task_id, why)
            elif isinstance(task, Task):
                open_step.sent(device, task)
                overdue = now - self.sent_at.setdefault(task_id, now) > self.resend_after_s
                if device in self.resend or overdue:
                    again[device] = task
                    self.sent_at[task_id] = now
            else:
                restored[device] = (task_id, round_)
        self.resend.clear()
        return again, restored

    @staticmethod
    def rebuild(tasks: dict[str, Task], restored: dict[str, tuple[str, int]]) -> dict[str, Task]:
        """The restored tasks in flight, taken out of the step's ``tasks``: each device's task
        under its old id and round (its payloads are the current version's; an agent that
        holds the task answers with its reply and never trains it again)."""
        return {
            d: dataclasses.replace(tasks.pop(d), task_id=task_id, round=round_)
            for d, (task_id, round_) in restored.items()
            if d in tasks
        }

    def save(self, open_step: OpenStep) -> None:
        """Record the open step's tasks (a restart resends them: a done one is answered
        with its stored reply, never trained again)."""
        if open_step.buffer_size:
            self.store.set_meta(TASKS_KEY, _rows(open_step.tasks))

    def fold(self, open_step: OpenStep, strategy: Strategy[Any]) -> dict[str, Any]:
        """Before a buffered step closes: weigh its replies (:meth:`weigh`); the tasks still
        in flight as the meta stored with its close (:meth:`close`). A synchronous step: none."""
        if not open_step.buffer_size:
            strategy.staleness_weights = {}
            return {}
        self.weigh(open_step, strategy)
        return self.close(open_step)

    def weigh(self, open_step: OpenStep, strategy: Strategy[Any]) -> None:
        """Each reply's staleness, and its weight handed to the strategy's aggregation."""
        now = open_step.step.round
        open_step.staleness = {d: now - r.round for d, r in open_step.outcome.replies.items()}
        strategy.staleness_weights = {
            r.task_id: self.rule.weight(open_step.staleness[d])
            for d, r in open_step.outcome.replies.items()
        }

    def close(self, open_step: OpenStep) -> dict[str, Any]:
        """The tasks still in flight after ``open_step`` closes (a failed task is not: its
        device gets a new one), as the meta to store with the close."""
        done = open_step.outcome.replies
        reasons = open_step.outcome.failed
        failed = {d for d, why in reasons.items() if not why.startswith("deadline")}
        self.tasks = {d: t for d, t in open_step.tasks.items() if d not in done and d not in failed}
        in_flight = {_ids(t)[0] for t in self.tasks.values()}
        self.sent_at = {i: t for i, t in self.sent_at.items() if i in in_flight}
        return {TASKS_KEY: _rows(self.tasks)}


def _ids(task: Task | tuple[str, int, str]) -> tuple[str, int, str]:
    return (task.task_id, task.round, task.phase) if isinstance(task, Task) else task


def _rows(tasks: dict[str, Task] | dict[str, Task | tuple[str, int, str]]) -> dict[str, Any]:
    return {d: list(_ids(t)) for d, t in sorted(tasks.items())}
