"""What the coordinator does with each message it takes off the transport: screening, then the
handler of its kind (registration, fetch, error, progress, an ingest worker's status), and the
one place a message is refused. :class:`~coordinator.engine.core.Coordinator` inherits it; the
state it uses is made by ``Coordinator.__init__``."""

from __future__ import annotations

import logging

from coordinator.engine.admission import Admission
from coordinator.engine.broadcast import KnowledgeBroadcast
from coordinator.engine.dispatch import MessageTable
from coordinator.engine.intake import ReplySource
from coordinator.engine.liveness import Presence
from coordinator.engine.observer import RunObserver
from coordinator.engine.replies import screen, screen_worker
from coordinator.engine.step import OpenStep
from coordinator.strategies.base import AgentInfo
from protocol.contract.codec import Envelope
from protocol.contract.messages import (
    BUDGET_SPENT,
    ErrorReply,
    Fetch,
    Progress,
    Register,
    Status,
    Task,
)
from protocol.contract.topics import Topics
from protocol.logs import RefusalLog
from protocol.transport.endpoint import Endpoint

__all__ = ["MessageHandlers"]


class MessageHandlers:
    """The message handling that :class:`~coordinator.engine.core.Coordinator` inherits."""

    endpoint: Endpoint
    topics: Topics
    log: logging.Logger
    observer: RunObserver
    rejected: dict[str, int]
    refusals: RefusalLog
    messages: MessageTable
    admission: Admission
    presence: Presence
    broadcast: KnowledgeBroadcast
    replies: ReplySource
    agents: dict[str, AgentInfo]
    _handling: Envelope | None
    _open_step: OpenStep | None

    def _handle(self, env: Envelope, topic: str) -> None:
        self._handling = env  # a refusal while handling it counts its bytes as refused
        try:
            self._dispatch(env, topic)
        finally:
            self._handling = None

    def _dispatch(self, env: Envelope, topic: str) -> None:
        worker = self.replies.worker_of(topic)
        if worker is not None:
            self._on_worker(env, worker)
            return
        refused = screen(self.topics, env, topic, self.endpoint.trusted(env))
        if refused is not None:
            self._reject(*refused)
            return
        if env.sender in self.agents:  # last seen, for `coordinator status`
            self.presence.heard(env.sender, env.body)
        handler = self.messages.handler(env.body)
        if handler is None:
            self._reject("unexpected_kind", f"{env.kind} from {env.sender}")
            return
        handler(env, env.body)

    def _on_register(self, env: Envelope, reg: Register) -> None:
        previous = self.admission.register(env, reg)
        if previous is None:  # not admitted
            return
        task = self._task_of(reg.device_id)
        # A restarted agent (or one whose broker session was lost) lost its task: send it
        # again. The same session registering again still has it queued: a resend made it
        # answer twice.
        if task is not None and not (reg.session and reg.session == previous):
            self._send_task(reg.device_id, task)

    def _on_fetch(self, env: Envelope, fetch: Fetch) -> None:
        self.broadcast.answer(env.sender, fetch, self._task_of(env.sender))

    def _on_error(self, env: Envelope, error: ErrorReply) -> None:
        """An agent says its task failed. Only a verified frame closes the device's slot
        early; an unverified one may be anyone's, so it is recorded and the step keeps waiting
        for the device until its deadline (a failing device costs the deadline, no more)."""
        device, what = env.sender, f"{error.code}: {error.reason}"
        if self._open_step is not None and self._task_of(device, error.task_id) is not None:
            if env.verified:
                self._open_step.fail(device, what)
                if error.code == BUDGET_SPENT:
                    self.admission.spend_out(device, error.reason)
            else:
                self._open_step.note(device, f"unverified error {what}")
        self.refusals("error", "agent %s reported %s: %s", device, error.code, error.reason)

    def _on_progress(self, env: Envelope, p: Progress) -> None:
        line = "%s round %d %s: %d/%d loss %.4f"
        self.log.debug(line, env.sender, p.round, p.phase, p.step, p.total, p.loss)

    def _on_worker(self, env: Envelope, worker: str) -> None:
        """An ingest worker came or went. One killed mid-step took the replies it held but had
        not stored: their devices got no ack and keep them in their outboxes, and an agent
        sent its task again answers with the stored reply (same message id, so never stored
        twice). The broker does not hand a dead member's messages to the others."""
        refused = screen_worker(env, worker, self.endpoint.sender, self.endpoint.trusted(env))
        if refused is not None:
            self._reject(*refused)
            return
        status, open_step = env.body, self._open_step
        assert isinstance(status, Status)  # screen_worker let only a status through
        self.log.info("ingest worker %s: %s", worker, status.state)
        if self.replies.on_status(worker, status) and open_step is not None:
            waiting = sorted(open_step.outstanding)
            self.log.warning("ingest workers changed: sending %d open tasks again", len(waiting))
            for device_id in waiting:
                self._send_task(device_id, open_step.tasks[device_id])

    def _send_task(self, device: str, task: Task) -> None:
        """Send ``device`` its task again, on its own (a step's tasks go out in one batch)."""
        self.endpoint.send(self.topics.down(device, "task"), task, round=task.round)

    def _task_of(self, device: str, task_id: str | None = None) -> Task | None:
        """The open step's task for ``device`` (``None`` if none, or if ``task_id`` differs)."""
        return None if self._open_step is None else self._open_step.task_of(device, task_id)

    def _reject(self, reason: str, detail: str) -> None:
        """Count and log a message not acted on; its bytes count as refused, not traffic."""
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        self.observer.refused(reason)
        if self._handling is not None:
            self.endpoint.refuse(self._handling)
            self._handling = None  # once, whatever else is refused about it
        self.refusals(reason, "rejected (%s): %s", reason, detail)
