"""An agent's standing with the coordinator: its announcement and registration, a deferred
or refused registration, the coordinator's retained state (a run starting, running or ended),
and signing off when told to stop.

:class:`Membership` is mixed into :class:`~edge_agent.agent.EdgeAgent`, whose state it shares:
the round's work (tasks, knowledge) stays in ``agent.py``, its evaluation, checkpoints and
export in ``round_outputs.py``.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from edge_agent.algorithms import EdgeAlgorithm, EdgeContext
from edge_agent.dp import DpSettings, release_counts
from edge_agent.run_end import RunEnd, archive_run, judge_end
from edge_agent.state import AgentState
from models.checkpoint import ModelSpec
from protocol.contract.codec import Envelope
from protocol.contract.messages import (
    Capabilities,
    CoordinatorState,
    ErrorReply,
    InputSpec,
    Register,
    Status,
)
from protocol.contract.topics import COORDINATOR_ID, Topics
from protocol.errors import EdgeFLError
from protocol.transport.endpoint import Endpoint

if TYPE_CHECKING:
    from edge_agent.agent import AgentSettings

__all__ = ["CONNECTED", "PRIVACY_LEDGER", "PRIVATE_ARCH", "VERSION", "Membership"]

PRIVACY_LEDGER = "privacy.json"  # the device's DP releases in the run (edge_agent.dp)
PRIVATE_ARCH = "private"  # registered instead of the name of a model that stays private
VERSION = "0.1.0"
CONNECTED = "\x00connected"  # not a run id: ids are printable
RATE_LIMIT_BACKOFF_S = 5.0  # first wait before registering again when the run turned us away
RATE_LIMIT_BACKOFF_MAX_S = 60.0


class Membership:
    """Registration and the coordinator's state, for :class:`~edge_agent.agent.EdgeAgent`."""

    # the agent's, set in its __init__
    settings: AgentSettings
    endpoint: Endpoint
    topics: Topics
    ctx: EdgeContext
    spec: ModelSpec
    algorithm: EdgeAlgorithm[Any]
    state: AgentState
    log: logging.Logger
    finished: threading.Event
    refusal: str | None
    end: RunEnd | None
    joined: set[str]
    finals_done: set[str]
    _session: str
    _registered_with: str | None
    _register_at: float | None
    _rate_limited: int
    discloses_counts: bool | None
    counts_dp: DpSettings | None

    def announce(self) -> None:
        """Retained birth, registration, and every reply not yet acknowledged."""
        me = self.settings.device_id
        self.endpoint.send(self.topics.status(me), Status(state="online"), retain=True)
        self.register()
        for topic, env in self.state.pending():
            self.log.info("resending unacknowledged %s %s", env.kind, env.msg_id)
            self.endpoint.send_envelope(topic, env)

    def register(self) -> None:
        """Tell the coordinator who we are and what data we hold: the samples of each class
        when the run's algorithm reads them, else only which classes and how many samples
        (:attr:`discloses_counts`; never data). Not before the run has said which."""
        if self.discloses_counts is None:
            self.log.info("registering once the coordinator's state says what the run needs")
            return
        ctx = self.ctx
        cuda = ctx.device.type == "cuda"
        caps = Capabilities(
            device=ctx.device.type,
            accelerator=torch.cuda.get_device_name(ctx.device) if cuda else "",
            memory_mb=(torch.cuda.get_device_properties(ctx.device).total_memory >> 20)
            if cuda
            else 0,
            cpu_count=torch.get_num_threads(),
        )
        h, w = self.spec.input_size
        histogram = self._histogram() if self.discloses_counts else ctx.class_counts
        held = {c: n for c, n in enumerate(histogram) if n > 0}
        counts = {str(c): n for c, n in held.items()} if self.discloses_counts else {}
        present = [] if self.discloses_counts else sorted(held)
        body = Register(
            device_id=self.settings.device_id,
            arch=self.spec.name if self.algorithm.discloses_model else PRIVATE_ARCH,
            num_params=(
                sum(p.numel() for p in ctx.model.parameters())
                if self.algorithm.discloses_model
                else 0
            ),
            capabilities=caps,
            input_spec=InputSpec(self.spec.in_chans, h, w),
            num_classes=ctx.num_classes,
            class_counts=counts,
            algorithm=self.algorithm.name,
            agent_version=VERSION,
            class_names=_wire_class_names(self.settings.class_names, ctx.num_classes),
            session=self._session,
            feature_dim=int(getattr(ctx.model, "num_features", 0))
            if self.algorithm.discloses_model
            else 0,
            classes=present,
            num_samples=sum(held.values()) if present else 0,
        )
        self.endpoint.send(self.topics.up(self.settings.device_id, "register"), body)

    def _histogram(self) -> list[int]:
        """The samples of each class as this device registers them: noised once under the
        run's ``hyper.dp`` when its state announced a budget (the same counts ever after, from
        the ledger), exact otherwise (docs/concepts/privacy.md)."""
        ledger = self.ctx.privacy
        if ledger.registered is not None:  # noised once: only those counts ever leave
            return list(ledger.registered)
        if self.counts_dp is None:
            return self.ctx.class_counts
        per_release = self.algorithm.DP_SUMS + 1  # as each reply's release composes
        return release_counts(self.ctx.class_counts, self.counts_dp, per_release, ledger)

    def _reported_samples(self, num_samples: int) -> int:
        """A reply's ``num_samples``: the registered histogram's total when it was noised (the
        coordinator bounds a reply's samples by the registered total, and the noised total
        may fall short of the true one), else ``num_samples``."""
        registered = self.ctx.privacy.registered
        return num_samples if registered is None else sum(registered)

    def _on_rate_limited(self, error: ErrorReply, env: Envelope) -> None:
        """Not admitted yet: the run's registration rate is spent. Register again after a
        back-off (5 s, doubling to at most 60 s, each with jitter so that a turned-away crowd
        does not return at once)."""
        if env.sender != COORDINATOR_ID:
            return
        self._rate_limited += 1
        delay = min(RATE_LIMIT_BACKOFF_MAX_S, RATE_LIMIT_BACKOFF_S * 2 ** (self._rate_limited - 1))
        delay *= random.uniform(0.5, 1.0)
        self._register_at = time.monotonic() + delay
        self.log.info(
            "registration deferred (%s); registering again in %.0f s", error.reason, delay
        )

    def _register_due(self) -> None:
        if self._register_at is not None and time.monotonic() >= self._register_at:
            self._register_at = None
            self.register()

    def on_refused(self, error: ErrorReply) -> None:
        """The coordinator will not admit us: say why and stop instead of waiting forever."""
        self.refusal = error.reason
        self.log.error("coordinator refused this agent: %s; stopping", error.reason)
        status = Status(state="done", detail=f"refused: {error.reason}"[:1000])
        self.endpoint.send(self.topics.status(self.settings.device_id), status, retain=True)
        self.finished.set()

    def _ignore_foreign_state(self, sender: str, state: CoordinatorState) -> None:
        """A state from another sender than the coordinator: the verify directory holds the
        devices' keys too, so a device could sign a ``finished`` that verifies. Counted,
        logged, never acted on, signed or not."""
        self.endpoint.rejected["foreign_coord_state"] += 1
        self.log.warning(
            "ignored a coordinator state %r of run %s sent by %r, not %r",
            state.state,
            state.run_id,
            sender,
            COORDINATOR_ID,
        )

    def _ignore_unsigned_state(self, state: CoordinatorState) -> None:
        """An unverified state other than ``offline``, with signatures required: the
        coordinator's last will says only ``offline``, so this is a forgery. Counted, logged,
        never acted on (a forged ``finished`` would end the agent, a forged ``starting`` make
        it register with a run that does not exist)."""
        self.endpoint.rejected["unsigned_coord_state"] += 1
        self.log.warning(
            "ignored an unsigned coordinator state %r of run %s: signatures are required",
            state.state,
            state.run_id,
        )

    def on_coordinator_state(self, state: CoordinatorState) -> None:
        """Re-register when a coordinator (re)starts; stop when our run is finished.

        How it ended (:attr:`end`) is judged by :func:`~edge_agent.run_end.judge_end`: a
        ``finished`` ends the run as completed only if this agent did the run's final phase.
        With signatures required only a verified state gets here (see below), so the message
        says whether the state was signed. In daemon mode (``exit_when_finished=False``) the
        agent archives the ended run's state and stays registered, so it takes part in the next
        run of its federation.

        With signatures required, :meth:`dispatch` passes only verified states here, and the
        unsigned ``offline`` will (a hint: the coordinator may not know us when it is back). A
        stale signed state never arrives (the endpoint refuses it), and a signed ``finished``
        of another run (an old one replayed) is ignored below: only the end of a run this
        agent joined ends it.
        """
        if state.state in ("starting", "running"):
            self.joined.add(state.run_id)
            # the run asks for another form of registration than the one sent (or none was
            # sent yet, see register): that one is due whatever the state says otherwise
            reform = state.class_counts != self.discloses_counts
            self.discloses_counts = state.class_counts
            self.counts_dp = _counts_dp(state)
            # `starting`: a coordinator (re)started and may not know us. `running` of the run
            # we registered with (or found running on connecting, when our connect's register
            # reached it) is that coordinator moving on or reconnecting: registering again
            # only cost traffic
            if state.state == "starting" or self._registered_with not in (
                state.run_id,
                CONNECTED,
            ):
                self.announce()
            elif reform:
                self.register()
            self._registered_with = state.run_id
            return
        self._registered_with = None
        if state.state != "finished":
            return
        if state.run_id not in self.joined:
            self.log.info(
                "run %s (round %d of %d) ended before this agent joined; waiting for a "
                "coordinator to start the next run",
                state.run_id,
                state.round,
                state.total_rounds,
            )
            return
        verified = self.endpoint.require_signatures
        end = judge_end(state, did_final=state.run_id in self.finals_done, verified=verified)
        self.end = end
        if end.kind == "completed":
            self.log.info("%s", end.message)
        else:
            self.log.error("%s", end.message)
        self.joined.discard(state.run_id)
        if self.settings.exit_when_finished:
            self.endpoint.send(
                self.topics.status(self.settings.device_id), Status(state="done"), retain=True
            )
        else:  # daemon: the caller builds a fresh agent for the next run on this state dir
            names = (self.state.checkpoint_path.name, "agent.json", "outbox", PRIVACY_LEDGER)
            archived = archive_run(self.settings.state_dir, state.run_id, names)
            self.log.info("run %s archived in %s; staying for the next run", state.run_id, archived)
        self.finished.set()

    def _sign_off(self) -> None:
        """Told to stop: say ``offline`` (retained) as the last will would have, since a clean
        disconnect does not publish it, so the coordinator stops choosing this agent."""
        status = Status(state="offline", detail="stopped")
        with contextlib.suppress(EdgeFLError):  # best effort: the broker may be gone too
            self.endpoint.send(self.topics.status(self.settings.device_id), status, retain=True)


def _wire_class_names(names: tuple[str, ...], num_classes: int) -> list[str]:
    """The class names to register: only a valid list (unique, one per class, 1..128 chars).

    A dataset's own names may repeat or be over-long (an ``.npz`` says what it likes); such a
    device registers unnamed classes rather than fail to start.
    """
    ok = (
        len(names) == num_classes
        and len(set(names)) == len(names)
        and all(1 <= len(n) <= 128 for n in names)
    )
    return list(names) if ok else []


def _counts_dp(state: CoordinatorState) -> DpSettings | None:
    """The budget under which ``state`` asks for the histogram noised (None: exact)."""
    if not (state.class_counts and state.dp_epsilon > 0):
        return None
    # the histogram's sensitivity is 1 without clipping: no vector is clipped, clip unused
    return DpSettings(state.dp_epsilon, state.dp_delta, 1.0, state.dp_releases)
