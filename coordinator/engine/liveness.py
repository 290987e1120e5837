"""Liveness both ways: the coordinator's retained state, published again as a heartbeat, and
which agents are online as their status messages say.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Literal

from coordinator.config import RunConfig
from coordinator.store.database import Store
from coordinator.strategies import Step
from protocol.algorithms import TrainConfig
from protocol.contract.messages import CoordinatorState, RoundDescriptor, Status
from protocol.contract.topics import Topics
from protocol.errors import EdgeFLError
from protocol.transport.endpoint import Endpoint

StateName = Literal["starting", "running", "finished", "offline"]

__all__ = ["Presence", "StateName", "StatePublisher"]


def _counts_dp(cfg: RunConfig) -> dict[str, Any]:
    """The run's ``hyper.dp`` budget as ``coord_state`` announces it to agents that register
    their histogram: they noise it under that budget (empty: DP off, the histogram exact). The
    budget announced is the per-class sums' part (all of it, or ``hyper.dp.share`` of it where
    DP-SGD trains weights that leave too) and their releases in the run, which the histogram's
    noise is calibrated with."""
    algo = cfg.algorithm_config()
    if not isinstance(algo, TrainConfig) or not algo.dp_epsilon:
        return {}
    releases = algo.dp_statistics_releases(max(1, algo.dp_releases))
    return {
        "dp_epsilon": algo.dp_statistics_epsilon(),
        "dp_delta": algo.dp_delta,
        "dp_releases": releases,
    }


class StatePublisher:
    """The coordinator's retained state on ``coord/state`` (what agents wait, train and stop
    by), and the open step's round descriptor."""

    def __init__(
        self,
        cfg: RunConfig,
        endpoint: Endpoint,
        topics: Topics,
        algorithm: str,
        feature_dim: int,
        *,
        class_counts: bool = True,
    ) -> None:
        self.cfg = cfg
        self.endpoint = endpoint
        self.topics = topics
        self.algorithm = algorithm
        self.feature_dim = feature_dim  # announced, so that adopting agents build that size
        self.class_counts = class_counts  # announced: agents disclose their histogram only then
        self.counts_dp = _counts_dp(cfg) if class_counts else {}
        self.state: tuple[StateName, int] = ("starting", 0)  # last published state and round
        self._next_heartbeat = 0.0  # monotonic time to publish the retained state again

    def publish(self, state: StateName, round_: int) -> None:
        """Publish ``state`` at ``round_``, retained."""
        self.state = (state, round_)
        body = CoordinatorState(
            state=state,
            run_id=self.cfg.run_id,
            algorithm=self.algorithm,
            round=round_,
            total_rounds=self.cfg.rounds,
            classes=list(self.cfg.classes),
            feature_dim=self.feature_dim,
            class_counts=self.class_counts,
            **self.counts_dp,
        )
        self.endpoint.send(self.topics.coord_state, body, retain=True)
        self._next_heartbeat = time.monotonic() + self.cfg.state_heartbeat_s

    def publish_round(self, step: Step, deadline: float, selected: list[str]) -> None:
        """Publish the round descriptor of the step whose tasks just went out, retained."""
        body = RoundDescriptor(
            run_id=self.cfg.run_id,
            round=step.round,
            phase=step.phase,
            deadline=deadline,
            selected=selected,
        )
        self.endpoint.send(self.topics.round, body, retain=True)

    def announce(self) -> None:
        """Publish the last state again: retained state is lost when a broker without
        persistence restarts."""
        self.publish(*self.state)

    def on_connect(self, session_present: bool) -> None:
        """The transport (re)connected."""
        state, round_ = self.state
        if not session_present and state == "running":
            # The broker lost our session (a restart without persistence): whatever agents
            # sent before we subscribed again is gone, including the registration and the
            # resent replies of an agent that reconnected first, and `running` alone does not
            # make agents announce again. `starting` does (register, resend unacknowledged
            # replies; a new agent session gets its task again); duplicates are deduplicated.
            self.publish("starting", round_)
        self.publish(state, round_)

    def heartbeat(self) -> None:
        """Publish the retained state again (freshly signed where signing is on) every
        ``state_heartbeat_s``.

        A signed frame is refused once its timestamp is older than the replay window (300 s,
        ``WIRE.md`` §7), so a retained state published once would be refused by every agent
        joining later. Signed or not, a fresh one also replaces, within one interval, a forged
        retained state that a broker without ACL let through (on an anonymous broker anyone can
        publish a retained ``finished``: agents that restart would otherwise read it for good).
        """
        if time.monotonic() < self._next_heartbeat:
            return
        with contextlib.suppress(EdgeFLError):  # a broker gone for now: the next pass retries
            self.publish(*self.state)


class Presence:
    """Which agents are online, and what the batch being handled said of each (stored with it,
    for ``coordinator status``)."""

    def __init__(self) -> None:
        self.online: set[str] = set()
        self._touched: dict[str, bool | None] = {}  # agents heard from in the batch: online?

    def heard(self, device: str, body: object) -> None:
        """A registered agent sent ``body``: it was seen now, and a status says its state."""
        online = body.state in ("online", "busy") if isinstance(body, Status) else None
        said = self._touched.get(device)  # the batch's last statement of its state holds
        self._touched[device] = said if online is None else online

    def on_status(self, device: str, status: Status) -> None:
        """An agent said whether it is online."""
        if status.state in ("online", "busy"):
            self.online.add(device)
        else:
            self.online.discard(device)

    def registered(self, device: str) -> None:
        """``device`` registered: it is online, and what the batch said of it before is older."""
        self.online.add(device)
        self._touched.pop(device, None)

    def flush(self, store: Store, now: float) -> list[str]:
        """Store what the batch heard, in the batch's transaction, as seen at ``now``; the
        devices heard."""
        touched, self._touched = self._touched, {}
        store.touch_agents(touched, now)
        return list(touched)
