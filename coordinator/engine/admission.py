"""Who may join a run: the engine's registration checks, then the strategy's, and the agents
admitted (and refused) so far.

New device ids are bounded: ``run.max_agents`` in all, ``run.max_registrations_per_min`` a
minute (a token bucket that holds at least ``run.min_agents``, so the fleet the run waits for
may come at once). Without signing anyone may register in any name; the bounds keep a flood
of forged devices from growing the fleet (and every step's quorum) without limit. A device
turned away by them is not remembered: a flood costs no memory.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from coordinator.config import RunConfig
from coordinator.engine.liveness import Presence
from coordinator.engine.step import OpenStep, QuorumError
from coordinator.ops.revocation import RevocationWatch
from coordinator.store.database import Store
from coordinator.strategies import AgentInfo, Strategy
from protocol.contract.codec import Envelope, encode
from protocol.contract.messages import RATE_LIMITED, REFUSED, ErrorReply, Register
from protocol.contract.topics import Topics
from protocol.errors import AdmissionError
from protocol.logs import listing
from protocol.transport.endpoint import Endpoint

REGISTRATIONS_LOGGED = 100  # new agents logged one line each; past that, one line a thousand
REVOKED = "its certificate was revoked"

__all__ = ["REGISTRATIONS_LOGGED", "Admission", "NewDevices"]


class Admission:
    """Registrations: each checked, then admitted (stored with its batch) or refused (told why)."""

    def __init__(
        self,
        cfg: RunConfig,
        strategy: Strategy[Any],
        endpoint: Endpoint,
        presence: Presence,
        *,
        log: logging.Logger,
        reject: Callable[[str, str], None],
        revocations: RevocationWatch | None = None,
    ) -> None:
        self.cfg = cfg
        self.strategy = strategy
        self.endpoint = endpoint
        self.topics = Topics(cfg.federation)
        self.presence = presence
        self.log = log
        self.reject = reject  # counts and logs a message that is not acted on
        self.agents: dict[str, AgentInfo] = {}
        self.refused: dict[str, str] = {}  # device -> why its latest registration was refused
        # device -> its PrivacyBudgetError: it trains for no further step of this run
        self.budget_spent: dict[str, str] = {}
        self._registered: dict[str, bytes] = {}  # registrations of the batch: their frames
        self._bucket = NewDevices(cfg.max_registrations_per_min, cfg.min_agents)
        self.revocations = revocations  # the coordinator kit's revocation list, if any
        self.revoked: frozenset[str] = frozenset()
        self.poll_revocations(None)  # before the first registration is judged

    def register(self, env: Envelope, reg: Register) -> str | None:
        """Admit or refuse ``reg``. Returns the session the agent registered with before
        (``""``: none), or ``None`` when it is not admitted."""
        if reg.device_id != env.sender:
            self.reject("sender_mismatch", f"register for {reg.device_id} sent by {env.sender}")
            return None
        known = reg.device_id in self.agents
        if not known and not self._room_for_new(env):
            return None
        agent = AgentInfo(reg.device_id, reg)
        try:
            self.check(agent)
        except AdmissionError as exc:
            self._refuse(env, exc)
            return None
        if not known:
            self._bucket.take()
        previous = self.agents[reg.device_id].register.session if known else ""
        self.refused.pop(reg.device_id, None)
        self.agents[reg.device_id] = agent
        self.presence.registered(reg.device_id)
        self._registered[reg.device_id] = env.wire or encode(env)  # stored with the batch
        if not known:
            self._log_registration(reg)
        return previous

    def _room_for_new(self, env: Envelope) -> bool:
        """Whether a new device may join now; if not, it is told why (and not remembered)."""
        if len(self.agents) >= self.cfg.max_agents:
            why = f"the run admits at most {self.cfg.max_agents} agents (run.max_agents)"
            self._turn_away(env, REFUSED, "refused_agent", why)
            return False
        if not self._bucket.available():
            rate = self.cfg.max_registrations_per_min
            why = f"more than {rate} new devices a minute (run.max_registrations_per_min)"
            self._turn_away(env, RATE_LIMITED, "rate_limited", f"{why}: register again later")
            return False
        return True

    def _turn_away(self, env: Envelope, code: str, counter: str, why: str) -> None:
        self.reject(counter, f"{env.sender}: {why}")
        body = ErrorReply(code=code, reason=why, ref_id=env.msg_id)
        self.endpoint.send(self.topics.down(env.sender, "error"), body)

    def check(self, agent: AgentInfo) -> None:
        """The engine's own checks, then the strategy's, against the agents admitted so far."""
        reg = agent.register
        if agent.device_id in self.revoked:
            raise AdmissionError(agent.device_id, REVOKED)
        if reg.algorithm != self.strategy.name:
            raise AdmissionError(
                agent.device_id, f"it runs {reg.algorithm}; this run is {self.strategy.name}"
            )
        if reg.num_classes != self.cfg.num_classes:
            raise AdmissionError(
                agent.device_id,
                f"it has {reg.num_classes} classes; this run has {self.cfg.num_classes}",
            )
        self._check_class_names(agent)
        if self.strategy.needs_class_counts and not reg.discloses_counts:
            raise AdmissionError(
                agent.device_id,
                f"it registered only its class set; {self.strategy.name} needs the samples of "
                "each class (class_counts)",
            )
        declared = self.strategy.declared_feature_dim()
        if declared and reg.feature_dim and reg.feature_dim != declared:
            # the run declares its prototypes' size: refuse now, not at the first reply
            raise AdmissionError(
                agent.device_id,
                f"its features have {reg.feature_dim} dimensions; this run's have {declared} "
                f"(--feature-dim {declared})",
            )
        if not self.strategy.admission_rules:
            return  # admits everyone: the fleet list cost O(N) a registration, O(N^2) a fleet
        fleet = [
            a
            for d, a in sorted(self.agents.items())
            if d != agent.device_id and d not in self.refused
        ]
        self.strategy.admit(agent, fleet)

    def poll_revocations(self, open_step: OpenStep | None) -> None:
        """Drop the devices the revocation list names since the last look (a cheap stat at most
        once a second): never selected again, and withdrawn from ``open_step``, whose quorum
        counts only the participants left. A connection of theirs may stay open (Mosquitto
        checks the CRL only at a handshake): whatever they send is refused from now on."""
        watch = self.revocations
        listed = watch.poll() if watch is not None else None
        if watch is None or listed is None:
            return
        new, self.revoked = listed - self.revoked, listed
        for device in sorted(new):
            self.refused[device] = REVOKED
            self.presence.online.discard(device)
            waited = open_step is not None and device in open_step.rec.participants
            self.log.warning(
                "agent %s revoked (%s): no longer selected%s",
                device,
                watch.path,
                "; the open step no longer waits for it" if waited else "",
            )
        if open_step is not None:
            self.withdraw_revoked(open_step)

    def withdraw_revoked(self, open_step: OpenStep) -> None:
        """Withdraw the revoked participants of ``open_step`` (a resumed step's too)."""
        for device in self.revoked.intersection(open_step.rec.participants):
            open_step.withdraw(device)

    def _check_class_names(self, agent: AgentInfo) -> None:
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
        self.reject("refused_agent", str(exc))
        self.refused[exc.device_id] = exc.reason
        # a re-registration that is refused now: never select
        self.presence.online.discard(exc.device_id)
        body = ErrorReply(code=REFUSED, reason=exc.reason, ref_id=env.msg_id)
        self.endpoint.send(self.topics.down(exc.device_id, "error"), body)

    def _log_registration(self, reg: Register) -> None:
        """One line per new agent up to ``REGISTRATIONS_LOGGED``, then one per thousand: at
        10,000 agents a line each was 10,000 lines and a third of registration's time."""
        count = len(self.agents)
        level = logging.INFO if count <= REGISTRATIONS_LOGGED else logging.DEBUG
        if self.log.isEnabledFor(level):
            samples = reg.total_samples()
            line = "agent %s registered: %s, %d params, %d samples"
            self.log.log(level, line, reg.device_id, reg.arch, reg.num_params, samples)
        if count > REGISTRATIONS_LOGGED and count % 1000 == 0:
            self.log.info("%d agents registered", count)

    def wait_for(self, count: int, timeout: float, pump: Callable[[float], None]) -> None:
        """Handle messages (``pump``) until ``count`` agents are registered and online."""
        end = time.monotonic() + timeout
        if self.online_count() < count:
            self.log.info(
                "waiting for %d agents of federation %s (up to %.0f s)",
                count,
                self.cfg.federation,
                timeout,
            )
        while self.online_count() < count:
            if time.monotonic() > end:
                raise QuorumError(
                    f"only {self.online_count()} of {count} required agents "
                    f"registered within {timeout:.0f} s{self.refusals()}"
                )
            pump(min(0.5, max(0.0, end - time.monotonic())))
        online = self.online_agents()
        self.log.info("%d agents online: %s", len(online), listing(online, REGISTRATIONS_LOGGED))

    def online_agents(self) -> list[str]:
        """The admitted agents online now, sorted."""
        online = self.presence.online
        return sorted(d for d in self.agents if d in online and d not in self.refused)

    def online_count(self) -> int:
        """``len(self.online_agents())`` with set operations in C: the registration wait asks
        on every pass of its loop, and sorting 10,000 ids each time cost seconds."""
        return len((self.presence.online & self.agents.keys()) - self.refused.keys())

    def spend_out(self, device: str, reason: str) -> None:
        """``device`` said (in a verified frame) that its privacy budget is spent: it is not
        selected again for a step that would ask it to train and release."""
        if device not in self.budget_spent:
            self.log.warning(
                "agent %s has spent its privacy budget, deselected: %s", device, reason
            )
        self.budget_spent[device] = reason

    def selectable(self, online: list[str], phase: str) -> list[str]:
        """``online`` less the devices whose budget is spent, except for the ``final`` step,
        which trains nothing and releases nothing but its evaluation."""
        if phase == "final" or not self.budget_spent:
            return online
        return [d for d in online if d not in self.budget_spent]

    def refusals(self) -> str:
        """Why agents were refused (for a quorum error: the cause is otherwise only in the
        agents' logs), e.g. FedAvg refusing a second architecture."""
        if not self.refused:
            return ""
        reasons = Counter(self.refused.values()).most_common(3)
        listed = "; ".join(f"{n} x {reason}" for reason, n in reasons)
        return f"; {len(self.refused)} refused at registration: {listed}"

    def spent_note(self) -> str:
        """How many devices were deselected for a spent privacy budget (for a quorum error)."""
        if not self.budget_spent:
            return ""
        return f"; {len(self.budget_spent)} deselected with their privacy budget spent"

    def flush(self, store: Store, now: float) -> list[str]:
        """Store the batch's registrations, in the batch's transaction, as seen at ``now``;
        the devices registered."""
        registered, self._registered = self._registered, {}
        store.upsert_agents(registered, now=now)  # one statement a batch, not one a message
        return list(registered)


class NewDevices:
    """A token bucket of new device ids: ``per_min`` a minute (0: no limit), holding at most
    ``max(per_min, burst)`` tokens, full at the start."""

    def __init__(
        self, per_min: int, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.per_s = per_min / 60.0
        self.capacity = float(max(per_min, burst))
        self.clock = clock
        self._tokens, self._at = self.capacity, clock()

    def available(self) -> bool:
        """Whether a new device may join now."""
        if not self.per_s:
            return True
        now = self.clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.per_s)
        self._at = now
        return self._tokens >= 1.0

    def take(self) -> None:
        """A new device joined."""
        if self.per_s:
            self._tokens -= 1.0
