"""Device profiles for simulation: slow, distant and flaky devices in a simulated fleet.

A profile file (TOML) describes the fleet as groups, each a share of the devices::

    seed = 0                 # which devices land in which group (default: the run's seed)

    [[group]]
    share = 0.2              # 20 % of the devices...
    speed = 10.0             # ...compute 10x slower
    speed_sigma = 0.0        # log-normal spread of each device's factor around `speed`

    [[group]]
    share = 0.1
    dropout = 1.0            # a task's reply never arrives (the device drops out of the round)

    [default]                # every device no group takes
    delay_s = 0.05           # one-way link latency
    uplink_bps = 1e6         # upload bandwidth (0: unlimited)
    dropout = 0.0

The profile acts on each simulated agent's transport (:class:`ProfiledTransport`), so the
in-process and Ray backends apply it the same way and the agent and coordinator code run
unchanged: a reply leaves ``(speed - 1) x`` the time the agent took after its task arrived,
plus both ways' latency (once per task) and its frames' upload time, later than it would have;
with probability ``dropout`` a task's reply (and every resend of it) is never delivered. Under
the real clock the waiting is real (wall-clock): runs under a profile take as long as the
profile says; under a simulated clock (:mod:`coordinator.sim.clock`) nothing is slept and each
reply is scheduled at its simulated arrival instead.
"""

from __future__ import annotations

import logging
import math
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protocol.contract.topics import Topics
from protocol.errors import ConfigError
from protocol.transport.base import Handler, Transport, WrappedTransport

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (JetPack 6)
    import tomli as tomllib

if TYPE_CHECKING:
    from coordinator.sim.clock import SimulatedClock

__all__ = ["DeviceProfile", "FleetProfile", "ProfileGroup", "ProfiledTransport", "load_profile"]

log = logging.getLogger("edgefl.sim.profile")


@dataclass(frozen=True)
class DeviceProfile:
    """How one simulated device departs from the machine it is simulated on."""

    speed: float = 1.0  # compute-time factor: 10 = ten times slower
    delay_s: float = 0.0  # one-way link latency, each way
    uplink_bps: float = 0.0  # upload bandwidth in bit/s (0: unlimited)
    dropout: float = 0.0  # probability that a task's reply never arrives

    def __post_init__(self) -> None:
        if not (self.speed >= 1.0 and self.delay_s >= 0 and self.uplink_bps >= 0):
            raise ConfigError(
                "profile: speed >= 1 (a device is never faster than the host that simulates "
                f"it), delay_s >= 0, uplink_bps >= 0; got {self.speed}, {self.delay_s}, "
                f"{self.uplink_bps}"
            )
        if not 0.0 <= self.dropout <= 1.0:
            raise ConfigError(f"profile: dropout must be in [0, 1], got {self.dropout}")

    def reply_delay(self, compute_s: float) -> float:
        """Seconds to hold back the reply to a task that took ``compute_s`` on this host: the
        slower compute and the latency both ways (once per task)."""
        return (self.speed - 1.0) * max(compute_s, 0.0) + 2.0 * self.delay_s

    def upload_s(self, size: int) -> float:
        """Seconds to upload ``size`` bytes (every frame of a reply, resends included)."""
        return 8.0 * size / self.uplink_bps if self.uplink_bps else 0.0


@dataclass(frozen=True)
class ProfileGroup:
    """A share of the fleet with one profile (its speed spread log-normally by ``speed_sigma``)."""

    share: float
    profile: DeviceProfile
    speed_sigma: float = 0.0


@dataclass(frozen=True)
class FleetProfile:
    """Groups of devices and the profile of the rest."""

    groups: tuple[ProfileGroup, ...] = ()
    default: DeviceProfile = field(default_factory=DeviceProfile)
    speed_sigma: float = 0.0  # the rest's log-normal speed spread
    seed: int | None = None  # the assignment's seed (None: the run's)

    def __post_init__(self) -> None:
        shares = [g.share for g in self.groups]
        if any(s < 0 for s in shares) or sum(shares) > 1.0 + 1e-9:
            raise ConfigError(f"profile: group shares must be >= 0 and sum to <= 1, got {shares}")

    def assign(self, num_devices: int, seed: int) -> list[DeviceProfile]:
        """Each device's profile: ``round(share x n)`` devices a group, drawn at random (seeded
        by the profile's seed, else ``seed``), the rest the default; a group with a speed
        spread gives each of its devices ``speed x exp(N(0, sigma))``, at least 1."""
        rng = random.Random(self.seed if self.seed is not None else seed)
        order = list(range(num_devices))
        rng.shuffle(order)
        out = [self.default] * num_devices
        start = 0
        for group in self.groups:
            count = round(group.share * num_devices)
            for index in order[start : start + count]:
                out[index] = _spread(group.profile, group.speed_sigma, rng)
            start += count
        for index in order[start:]:
            out[index] = _spread(self.default, self.speed_sigma, rng)
        return out


def _spread(profile: DeviceProfile, sigma: float, rng: random.Random) -> DeviceProfile:
    if sigma <= 0:
        return profile
    speed = max(1.0, profile.speed * math.exp(rng.gauss(0.0, sigma)))
    return DeviceProfile(speed, profile.delay_s, profile.uplink_bps, profile.dropout)


_PROFILE_KEYS = {f.name for f in fields(DeviceProfile)}


def _device_profile(table: dict[str, Any], where: str) -> DeviceProfile:
    unknown = sorted(set(table) - _PROFILE_KEYS)
    if unknown:
        raise ConfigError(
            f"profile {where}: unknown keys {unknown}; known: {sorted(_PROFILE_KEYS)}"
        )
    try:
        return DeviceProfile(**{k: float(v) for k, v in table.items()})
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"profile {where}: {exc}") from exc


def load_profile(path: str | Path) -> FleetProfile:
    """Read a profile file (the module's docstring shows the format)."""
    try:
        doc = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"profile {path}: {exc}") from exc
    unknown = sorted(set(doc) - {"group", "default", "seed"})
    if unknown:
        raise ConfigError(f"profile {path}: unknown tables {unknown}; known: default, group, seed")
    groups = []
    for i, raw in enumerate(doc.get("group", [])):
        table = dict(raw)
        share = float(table.pop("share", 0.0))
        sigma = float(table.pop("speed_sigma", 0.0))
        groups.append(ProfileGroup(share, _device_profile(table, f"group {i + 1}"), sigma))
    default = dict(doc.get("default", {}))
    sigma = float(default.pop("speed_sigma", 0.0))
    seed = doc.get("seed")
    return FleetProfile(
        tuple(groups),
        _device_profile(default, "default"),
        sigma,
        None if seed is None else int(seed),
    )


class ProfiledTransport(WrappedTransport):
    """One simulated device's transport, departing from the host as its profile says: a
    task's arrival starts the clock, the reply to it is held back by
    :meth:`DeviceProfile.reply_delay`, or with probability ``dropout`` never delivered
    (nor any resend of it, until the next task arrives). Everything else passes unchanged.

    With ``simulated`` (a :class:`~coordinator.sim.clock.SimulatedClock`) nothing is slept: the
    reply is handed to that clock to deliver at the task's simulated arrival + the compute time
    measured here (``clock``) x ``speed`` (after the device's previous task: it computes one at
    a time) + both ways' latency + its upload time."""

    def __init__(
        self,
        inner: Transport,
        profile: DeviceProfile,
        topics: Topics,
        device_id: str,
        *,
        seed: int,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        simulated: SimulatedClock | None = None,
    ) -> None:
        super().__init__(inner)
        self.profile = profile
        self.task_topic = topics.down(device_id, "task")
        self.reply_topic = topics.up(device_id, "reply")
        self.topics = topics
        self.rng = random.Random(seed)
        self.sleep, self.clock = sleep, clock
        self._lock = threading.Lock()
        self._arrived: float | None = None  # when the current task arrived; None: delayed
        self._dropped = False  # the current task's reply is lost
        self.dropped_tasks = 0
        self.device_id, self.simulated = device_id, simulated
        self._task_at = 0.0  # simulated time of the current task's dispatch
        self._free_at = 0.0  # simulated time at which the device ends its last computation
        self._last_at = 0.0  # simulated arrival of its last reply frame

    def _on_task(self, topic: str) -> None:
        if topic == self.task_topic or self.topics.message_topic(topic) == self.task_topic:
            with self._lock:
                self._arrived = self.clock()
                self._dropped = self.rng.random() < self.profile.dropout
                self.dropped_tasks += self._dropped
                if self.simulated is not None:
                    self._task_at = self.simulated.monotonic()
        elif self.simulated is not None:
            self.simulated.moved(self.device_id)

    def subscribe(self, topic_filter: str, handler: Handler, qos: int = 1) -> None:
        def watched(topic: str, payload: bytes) -> None:
            self._on_task(topic)  # never blocks: the delivery thread must not wait
            handler(topic, payload)

        self.inner.subscribe(topic_filter, watched, qos)

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        if topic == self.reply_topic or self.topics.message_topic(topic) == self.reply_topic:
            with self._lock:
                arrived, dropped, task_at = self._arrived, self._dropped, self._task_at
                self._arrived = None  # the compute delay once per task, not per frame or resend
            if dropped:
                log.debug("%s: reply dropped (profile dropout)", topic)
                if self.simulated is not None:
                    self.simulated.idle(self.device_id)
                return
            if self.simulated is not None:
                self._hold(topic, payload, arrived, task_at, qos=qos, retain=retain)
                return
            delay = self.profile.upload_s(len(payload))
            if arrived is not None:
                delay += self.profile.reply_delay(self.clock() - arrived)
            self.sleep(delay)
        elif self.simulated is not None:
            self.simulated.moved(self.device_id)
        self.inner.publish(topic, payload, qos=qos, retain=retain)

    def _hold(
        self,
        topic: str,
        payload: bytes,
        arrived: float | None,
        task_at: float,
        *,
        qos: int,
        retain: bool,
    ) -> None:
        """Schedule a reply frame on the simulated clock (the class docstring's sum):
        ``arrived``: when its task arrived here (``None``: a later frame of the reply, or a
        resend), ``task_at``: when it went out, in simulated time."""
        sim, p = self.simulated, self.profile
        assert sim is not None  # called only under a simulated clock
        if arrived is not None:  # the reply's first frame: the task was computed
            compute = self.clock() - arrived if sim.compute_s is None else sim.compute_s
            start = max(task_at + p.delay_s, self._free_at)  # one task at a time
            self._free_at = start + p.speed * max(compute, 0.0)
            at = self._free_at + p.delay_s
        else:
            at = max(self._last_at, sim.monotonic())
        self._last_at = at + p.upload_s(len(payload))
        inner = self.inner
        sim.hold(
            self.device_id,
            self._last_at,
            payload,
            lambda: inner.publish(topic, payload, qos=qos, retain=retain),
        )
