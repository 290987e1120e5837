"""The device runtime: register, receive tasks, train, evaluate, reply, checkpoint, resume.

Messages from the transport thread land in a queue; one thread (the caller of :meth:`run`)
does all the work, so the model is never touched concurrently. Replies are written to the
on-disk outbox before they are sent and removed only when the coordinator acknowledges them:
a restarted agent resends them with the same message id, and the coordinator deduplicates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from edge_agent.algorithms import EdgeAlgorithm
from edge_agent.best_model import BestRound, ValidationSplit
from edge_agent.dp import DpSettings, PrivacyLedger
from edge_agent.knowledge_cache import FetchPolicy, KnowledgeCache, KnowledgeError, Waiting, merge
from edge_agent.membership import CONNECTED, PRIVACY_LEDGER, Membership
from edge_agent.progress import TerminalProgress
from edge_agent.round_outputs import RoundOutputs
from edge_agent.run_end import FINAL_PHASE, RunEnd
from edge_agent.state import AgentState
from edge_agent.trainer import TrainingStoppedError
from models.checkpoint import ModelSpec, load_checkpoint
from models.trace_guard import TRACE_GUARD
from protocol.contract.codec import Envelope
from protocol.contract.messages import (
    RATE_LIMITED,
    REFUSED,
    STOPPED,
    UNKNOWN_KNOWLEDGE,
    Ack,
    CoordinatorState,
    ErrorReply,
    Fetch,
    Knowledge,
    Progress,
    Reply,
    Task,
    task_inputs_digest,
)
from protocol.contract.topics import COORDINATOR_ID, Topics
from protocol.errors import EdgeFLError, ValidationError
from protocol.transport.endpoint import Endpoint

__all__ = ["AgentSettings", "EdgeAgent"]

IDLE_WAIT_S = 1.0  # longest wait for a message: how late a stop or an idle timeout is seen


class _Answer(NamedTuple):
    """The agent's last reply, the digest of its task's inputs and its message id."""

    inputs: bytes
    reply: Reply
    msg_id: str


@dataclass(frozen=True)
class AgentSettings:
    """Identity and behaviour of one agent."""

    device_id: str
    state_dir: Path
    federation: str = "default"
    exit_when_finished: bool = True
    export_dir: Path | None = None
    class_names: tuple[str, ...] = ()
    progress_interval_s: float = 1.0
    extra_register: dict[str, Any] = field(default_factory=dict)
    # evaluate after every N-th training round (other phases always): evaluating a large
    # global test set every round can cost more than the round's training
    eval_every: int = 1
    # score the global test set only every N-th evaluated training round (other phases always):
    # it is often many times a client's own test split, so it dominates an evaluation
    global_eval_every: int = 1
    # register the label histogram (True) or only the class set and size (False), as the run's
    # algorithm needs (``CoordinatorState.class_counts``); None: not known yet, so register
    # only once the coordinator's state says which (an agent that joins by its own flags)
    class_counts: bool | None = True


class EdgeAgent(Membership, RoundOutputs):
    """One device of the federation."""

    def __init__(
        self,
        endpoint: Endpoint,
        algorithm: EdgeAlgorithm[Any],
        spec: ModelSpec,
        settings: AgentSettings,
        logger: logging.Logger | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.algorithm = algorithm
        self.ctx = algorithm.ctx
        self.spec = spec
        self.settings = settings
        self.topics = Topics(settings.federation)
        self.state = AgentState(settings.state_dir)
        self.log = logger or logging.getLogger(f"edgefl.agent.{settings.device_id}")
        self.inbox: queue.Queue[Envelope] = queue.Queue()
        self.history: list[dict[str, float]] = []
        self.finished = threading.Event()
        self.refusal: str | None = None  # the coordinator's reason, if it refused us
        self.end: RunEnd | None = None  # how our run ended, once it did
        # runs this agent took part in: only their end ends it (a retained "finished" of an
        # earlier run must not stop an agent that arrives for the next one)
        self.joined: set[str] = set()
        # runs whose final phase this agent answered: only they can end as completed
        self.finals_done: set[str] = set()
        self._current: Task | None = None
        # the last reply and its task's inputs: a retry of that step gets it again
        self._answer: _Answer | None = None
        # the round's shared payloads (WIRE.md §5, knowledge) and the tasks waiting for theirs
        self.knowledge = KnowledgeCache()
        self.fetch_policy = FetchPolicy()
        self._waiting: dict[str, Waiting] = {}  # task id -> its wait
        self._session = secrets.token_hex(8)  # see Register.session
        # run id of the live coordinator our registration reached (CONNECTED: the one, if
        # any, that was live when we connected); a repeat of its state needs no new register
        self._registered_with: str | None = None
        # the coordinator turned us away for now (registration rate): register again then
        self._register_at: float | None = None
        self._rate_limited = 0  # consecutive times, for the back-off
        self.discloses_counts = settings.class_counts  # what register() sends (None: waits)
        self.counts_dp: DpSettings | None = None  # the budget the run noises the histogram by
        self._last_progress = 0.0
        self._bar = TerminalProgress(settings.device_id)  # draws only on a terminal
        self.ctx.on_progress = self._progress
        self.split = ValidationSplit(self.ctx, settings.device_id, self.log)
        self.best = BestRound(self.state.checkpoint_path, self.log)
        # the releases this device made in the run (hyper.dp), kept across restarts
        self.ctx.privacy = PrivacyLedger(settings.state_dir / PRIVACY_LEDGER)
        self._restore()

    # ----- set-up ---------------------------------------------------------------------------
    def _restore(self) -> None:
        path = self.state.checkpoint_path
        if not path.exists():
            return
        ckpt = load_checkpoint(path)
        if ckpt.meta.get("run_id"):
            self.joined.add(str(ckpt.meta["run_id"]))
            if ckpt.meta.get("phase") == FINAL_PHASE:
                self.finals_done.add(str(ckpt.meta["run_id"]))
        self.ctx.model.load_state_dict(ckpt.state_dict)
        self.algorithm.restore_state(dict(ckpt.extra))
        self.log.info("resumed from %s (round %s)", path, ckpt.meta.get("round"))

    def start(self) -> None:
        """Subscribe and announce ourselves on every (re)connect of the transport.

        Call before or after ``transport.connect()``: subscriptions made before connecting also
        receive what the broker queued for our persistent session while we were away.
        """
        me = self.settings.device_id
        self.endpoint.subscribe(f"{self.topics.base}/dev/{me}/down/#", self._enqueue)
        self.endpoint.subscribe(self.topics.coord_state, self._enqueue)
        self.endpoint.subscribe(self.topics.bcast(Knowledge.KIND), self._enqueue)
        self.endpoint.transport.add_connect_listener(self._on_connect)
        if self.endpoint.transport.connected:
            self._on_connect(session_present=False)

    def _on_connect(self, session_present: bool) -> None:
        if not session_present:  # tasks queued for us are gone: the coordinator must resend
            self._session = secrets.token_hex(8)
        self._registered_with = CONNECTED
        self.announce()

    def _enqueue(self, env: Envelope, topic: str) -> None:
        self.inbox.put(env)

    @property
    def gave_up(self) -> str | None:
        """Why our run ended before its last round (``None``: it did not, or not yet)."""
        return self.end.message if self.end is not None and self.end.kind == "gave_up" else None

    # ----- main loop ------------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None, idle_timeout: float | None = None) -> None:
        """Process messages until the run finishes, ``stop`` is set or ``idle_timeout`` passes.

        ``stop`` also reaches the training loop (``EdgeContext.stop``): a task being trained
        ends within one batch, with an ``error`` ``stopped`` instead of a reply.
        """
        stop = stop or threading.Event()
        self.ctx.stop = stop
        try:
            self._loop(stop, idle_timeout)
        finally:
            self.ctx.stop = None
        if stop.is_set() and not self.finished.is_set():
            self._sign_off()

    def _loop(self, stop: threading.Event, idle_timeout: float | None) -> None:
        last_activity = time.monotonic()
        while not stop.is_set() and not self.finished.is_set():
            self._fetch_due()
            self._register_due()
            try:
                env = self.inbox.get(timeout=self._idle_wait())
            except queue.Empty:
                if idle_timeout is not None and time.monotonic() - last_activity > idle_timeout:
                    self.log.warning("no message for %.0f s; stopping", idle_timeout)
                    return
                continue
            last_activity = time.monotonic()
            self.dispatch(env)

    def dispatch(self, env: Envelope) -> None:
        """Handle one message."""
        body = env.body
        if isinstance(body, Task):
            self.on_task(body, env)
        elif isinstance(body, Ack):
            if self.state.ack(body.ref_id):
                self.log.debug("reply %s acknowledged", body.ref_id)
            if not body.accepted:
                self.log.warning("coordinator refused %s: %s", body.ref_id, body.reason)
                if self._answer is not None and self._answer.msg_id == body.ref_id:
                    self._answer = None  # refused as it is: a retry must compute afresh
        elif isinstance(body, CoordinatorState):
            if env.sender != COORDINATOR_ID:
                self._ignore_foreign_state(env.sender, body)
            elif self.endpoint.trusted(env) or body.state == "offline":
                self.on_coordinator_state(body)
            else:
                self._ignore_unsigned_state(body)
        elif isinstance(body, Knowledge):
            self.on_knowledge(body, env)
        elif isinstance(body, ErrorReply) and body.code == REFUSED:
            self.on_refused(body)
        elif isinstance(body, ErrorReply) and body.code == RATE_LIMITED:
            self._on_rate_limited(body, env)
        elif isinstance(body, ErrorReply) and body.code == UNKNOWN_KNOWLEDGE:
            self._on_unknown_knowledge(body, env)
        else:
            self.log.debug("ignoring %s from %s", env.kind, env.sender)

    # ----- broadcast knowledge (WIRE.md §5) -------------------------------------------------
    def on_knowledge(self, knowledge: Knowledge, env: Envelope) -> None:
        """Hold the coordinator's knowledge (its digest was checked when it was decoded) and
        run the tasks that waited for it."""
        if not self._from_coordinator(env, "knowledge"):
            return
        self.knowledge.put(knowledge)
        for task_id, waiting in list(self._waiting.items()):
            if waiting.task.shared == knowledge.digest:
                del self._waiting[task_id]
                self.log.info("knowledge %s arrived", knowledge.digest.hex()[:16])
                self.on_task(waiting.task, env)

    def _from_coordinator(self, env: Envelope, what: str) -> bool:
        """Whether ``env`` is the coordinator's, verified where signing is on; else counted
        (``foreign_WHAT``, ``unsigned_WHAT``) and logged. A device's key verifies its own
        frames too, so the sender must also be the coordinator's id."""
        if env.sender == COORDINATOR_ID and self.endpoint.trusted(env):
            return True
        why = "foreign" if env.sender != COORDINATOR_ID else "unsigned"
        self.endpoint.rejected[f"{why}_{what}"] += 1
        self.log.warning("ignored %s %s from %r", why, what, env.sender)
        return False

    def _park(self, task: Task) -> None:
        """The task's knowledge is not here (a late join, a lost session): ask for it."""
        if task.task_id in self._waiting:  # the task again: its fetches are under way
            return
        waiting = Waiting.park(task, self.fetch_policy)
        self._waiting[task.task_id] = waiting
        self.log.info("task %s waits for knowledge %s", task.task_id, task.shared.hex()[:16])
        self._fetch(waiting)

    def _fetch(self, waiting: Waiting) -> None:
        waiting.tries += 1
        waiting.next_at = time.monotonic() + self.fetch_policy.wait(waiting.tries)
        topic = self.topics.up(self.settings.device_id, Fetch.KIND)
        try:
            self.endpoint.send(topic, Fetch(digest=waiting.task.shared), round=waiting.task.round)
        except EdgeFLError as exc:  # a broker gone for now: the next try goes again
            self.log.warning("fetch of %s failed: %s", waiting.task.shared.hex()[:16], exc)

    def _idle_wait(self) -> float:
        """How long the loop may wait for a message: until the next fetch is due, at most
        ``IDLE_WAIT_S``. An idle agent wakes once a second, not five times: a process of 500
        simulated agents (a Ray actor) woke 2,500 times a second for nothing, each wakeup
        taking the GIL from the threads with work to do."""
        wait = IDLE_WAIT_S
        if self._waiting:
            now = time.monotonic()
            due = min(min(w.next_at, w.give_up_at) for w in self._waiting.values())
            wait = min(wait, max(0.0, due - now))
        return wait

    def _fetch_due(self) -> None:
        """Fetch again what is still missing; fail a task whose knowledge never came."""
        now = time.monotonic()
        for task_id, waiting in list(self._waiting.items()):
            out_of_tries = waiting.tries >= self.fetch_policy.attempts and now >= waiting.next_at
            if now >= waiting.give_up_at or out_of_tries:
                del self._waiting[task_id]
                self._fail_waiting(waiting, f"not received after {waiting.tries} fetches")
            elif now >= waiting.next_at:
                self._fetch(waiting)

    def _on_unknown_knowledge(self, error: ErrorReply, env: Envelope) -> None:
        """The coordinator cannot serve our fetch (its step moved on): fail the task now."""
        if not self._from_coordinator(env, UNKNOWN_KNOWLEDGE):
            return
        for task_id, waiting in list(self._waiting.items()):
            if waiting.task.shared.hex() == error.ref_id:
                del self._waiting[task_id]
                self._fail_waiting(waiting, f"the coordinator answered: {error.reason}")

    def _fail_waiting(self, waiting: Waiting, why: str) -> None:
        task = waiting.task
        exc = KnowledgeError(
            f"task {task.task_id} needs knowledge {task.shared.hex()} (round {task.round}): {why}"
        )
        self._fail(task, self.topics.up(self.settings.device_id, "reply"), exc)

    def on_task(self, task: Task, env: Envelope) -> None:
        """Run a task once; a repeated task id gets the stored reply again."""
        self._rate_limited = 0  # admitted: a later deferral starts its back-off afresh
        reply_topic = self.topics.up(self.settings.device_id, "reply")
        done_id = self.state.completed_reply(task.task_id)
        if done_id is not None:
            resent = False
            for topic, pending in self.state.pending():
                if pending.msg_id == done_id:
                    self.endpoint.send_envelope(topic, pending)
                    resent = True
            if not resent:  # acknowledged (or refused) already: training twice would be wrong
                self.log.warning("task %s repeated after its reply was acknowledged", task.task_id)
            return
        if task.shared:
            known = self.knowledge.get(task.shared)
            if known is None:
                self._park(task)
                return
            try:
                task = merge(task, known)
            except ValidationError as exc:
                self._fail(task, reply_topic, exc)
                return
        self._run_task(task, reply_topic)

    def _run_task(self, task: Task, reply_topic: str) -> None:
        """Train or evaluate as ``task`` says, checkpoint, and reply (durably)."""
        inputs = task_inputs_digest(task)
        if self._answer is not None and self._answer.inputs == inputs:
            self._answer_again(task, inputs, self._answer.reply, reply_topic)
            return
        self._current = task
        self.log.info("round %d phase %s: %s", task.round, task.phase, task.task_id)
        try:
            self.split.use(self.algorithm.parse_config(task).validation_fraction)
            with TRACE_GUARD.running():  # not while another agent of this process exports
                result = self.algorithm.handle(task)
                evaluated = self._evaluate(task) if self._evaluates(task) else {}
            metrics = {**result.metrics, **evaluated}
            if task.phase == FINAL_PHASE:
                with TRACE_GUARD.tracing():  # the export's checks run the model too
                    metrics.update(self._export_safely(task, metrics))
        except TrainingStoppedError as exc:
            self._bar.close()
            self._stopped(task, reply_topic, exc)
            return
        except EdgeFLError as exc:
            self._bar.close()
            self._fail(task, reply_topic, exc)
            return
        except Exception as exc:  # a bug must cost one task, not the device's process
            self._bar.close()
            self.log.exception("task %s crashed", task.task_id)
            self._fail(task, reply_topic, exc)
            return
        finally:
            self._current = None
        if task.phase == FINAL_PHASE:
            self.finals_done.add(task.run_id)
        self.history.append({"round": float(task.round), **metrics})
        self.log.info("round %d %s: %s", task.round, task.phase, _fmt_metrics(metrics))
        self._save_checkpoint(task)
        try:
            reply = Reply(
                task_id=task.task_id,
                round=task.round,
                phase=task.phase,
                num_samples=self._reported_samples(result.num_samples),
                payloads=result.payloads,
                metrics=metrics,
            )
        except ValidationError as exc:  # e.g. a diverged model's NaN loss: one task fails
            self._fail(task, reply_topic, exc)  # and says why; the device lives on
            return
        self._answer = _Answer(inputs, reply, self._send_reply(task, reply, reply_topic))

    def _answer_again(self, task: Task, inputs: bytes, earlier: Reply, reply_topic: str) -> None:
        """A later attempt of the step this agent answered last (the same inputs: the
        coordinator retried it after a deadline or a lost reply) gets the same answer under
        its own id. Training again would train the model twice for one round and spend a
        second release of its privacy budget; and on a device slower than the deadline, a
        retry queued behind the late attempt would miss it again."""
        self.log.info(
            "task %s has the inputs of %s: answering with its reply", task.task_id, earlier.task_id
        )
        reply = dataclasses.replace(earlier, task_id=task.task_id)
        self._answer = _Answer(inputs, reply, self._send_reply(task, reply, reply_topic))

    def _send_reply(self, task: Task, reply: Reply, reply_topic: str) -> str:
        """Send ``reply`` (durably first); return its message id."""
        out = Envelope(
            body=reply,
            sender=self.settings.device_id,
            federation=self.settings.federation,
            round=task.round,
        )
        self.state.put_outbox(reply_topic, out)  # durable before it leaves
        self.state.mark_completed(task.task_id, out.msg_id)
        self.endpoint.send_envelope(reply_topic, out)
        return out.msg_id

    def _stopped(self, task: Task, topic: str, exc: TrainingStoppedError) -> None:
        """The task was cut short by a stop: no half-trained reply. An ``error`` ``stopped``
        tells the coordinator at once that no result comes for it (instead of its deadline);
        the state directory keeps the checkpoint of the last completed task, and the task runs
        again from it when the coordinator sends it again (it is not marked completed)."""
        self.log.warning("task %s %s; no result sent for it", task.task_id, exc)
        reason = f"the agent was stopped during the task ({exc}); no result"
        body = ErrorReply(code=STOPPED, reason=reason, task_id=task.task_id)
        with contextlib.suppress(EdgeFLError):  # best effort: the broker may be gone too
            self.endpoint.send(topic, body, round=task.round)

    def _fail(self, task: Task, topic: str, exc: Exception) -> None:
        self.log.error("task %s failed: %s: %s", task.task_id, type(exc).__name__, exc)
        body = ErrorReply(code=type(exc).__name__, reason=str(exc)[:1000], task_id=task.task_id)
        self.endpoint.send(topic, body, round=task.round)

    def _progress(self, step: int, total: int, loss: float) -> None:
        task = self._current
        if task is None:
            return
        self._bar.update(task.round, task.phase, step, total, loss)
        now = time.monotonic()
        if now - self._last_progress < self.settings.progress_interval_s and step != total:
            return
        self._last_progress = now
        body = Progress(
            task_id=task.task_id,
            round=task.round,
            phase=task.phase,
            step=step,
            total=total,
            loss=loss if math.isfinite(loss) else 0.0,
        )
        with contextlib.suppress(EdgeFLError):  # progress is best effort; the reply counts
            self.endpoint.send(self.topics.progress(self.settings.device_id), body, qos=0)


def _fmt_metrics(metrics: dict[str, float]) -> str:
    """``acc_local 0.912, loss_local 0.301, ...``: the evaluation first, then the rest."""
    first = ("acc_local", "loss_local", "acc_global", "loss_global")
    keys = [k for k in first if k in metrics] + sorted(k for k in metrics if k not in first)
    return ", ".join(f"{k} {metrics[k]:.4g}" for k in keys) or "no metrics"
