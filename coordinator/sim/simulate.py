"""Many agents in one process, same code paths as a real fleet (``coordinator simulate``).

Agents run in threads over the in-memory transport by default, or over a real broker when one
is given; ``backend="ray"`` spreads them over Ray actors (``coordinator.sim.ray_backend``). Each
agent computes its own shard from the shared partition spec, exactly as separate ``edge-agent``
processes do.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from coordinator.config import RunConfig
from coordinator.engine.core import RunResult
from coordinator.engine.runner import coordinator_will, run_coordinator
from coordinator.sim.profile import FleetProfile, ProfiledTransport
from protocol.algorithms.base import DEFAULT_FEATURE_DIM
from protocol.contract.codec import Envelope, encode
from protocol.contract.messages import Status
from protocol.contract.topics import Topics
from protocol.errors import ConfigError
from protocol.transport.base import MemoryBroker, MemoryTransport, Transport, Will

if TYPE_CHECKING:
    from coordinator.engine.observer import RunObserver
    from coordinator.sim.clock import SimulatedClock
    from coordinator.sim.ray_backend import RayOptions

__all__ = [
    "DEFAULT_FAMILY",
    "ONE_ARCHITECTURE_FAMILY",
    "AgentThreads",
    "FleetSpec",
    "TransportFactory",
    "check_fleet",
    "default_family",
    "gil_slice",
    "simulate",
]


# the model family of a simulation: heterogeneous, except for an algorithm that averages whole
# models (``Strategy.one_architecture``), which gets one architecture unless told otherwise
DEFAULT_FAMILY = "tiny"
ONE_ARCHITECTURE_FAMILY = "homo_mlp"

# (client_id, will) -> an unconnected transport
TransportFactory = Callable[[str, Will], Transport]

# The GIL switch interval of a process that hosts many agents over the network, each with a
# network thread that must answer the broker's keepalive. A thread waiting for the GIL wakes
# once per interval to ask for it, so at CPython's 5 ms, 100 agents' ~200 threads ask for up
# to 40,000 wake-ups a second: on 2 cores, 10 Ray actors of 100 agents spent their CPU in
# ~29 us slices of GIL hand-offs, clients went silent past the broker's keepalive, and the
# second round reached its deadline with 999 of 1,000 replies after ~600 lost connections.
# 1 ms per agent keeps the wake-ups per second about constant as a process hosts more agents;
# the cap bounds how long a thread computing in Python keeps the others waiting. Agents on the
# in-memory transport have no network threads, and there the longer slice made 300 agents
# 5-10 % slower (the coordinator's thread waits longer for the GIL): they keep CPython's.
GIL_SLICE_PER_AGENT_S = 0.001
GIL_SLICE_MAX_S = 0.1


def gil_slice(agents: int, default: float) -> float:
    """The switch interval for a process hosting ``agents`` agents (never below ``default``)."""
    return max(default, min(GIL_SLICE_MAX_S, agents * GIL_SLICE_PER_AGENT_S))


@dataclass(frozen=True)
class FleetSpec:
    """The simulated devices: architectures, data and its partition."""

    num_agents: int
    models: tuple[str, ...]
    # the rest by keyword only: a field added in the middle silently shifted positional
    # callers (a global test size of 200 became an image size of 200)
    _: KW_ONLY
    data: str = "digits"
    partition: str = "dirichlet:0.5"
    feature_dim: int | None = DEFAULT_FEATURE_DIM
    feature_act: str | None = None  # "relu" after the projection
    image_size: int | None = None
    global_test_size: int = 360
    test_fraction: float = 0.2  # share of each client's samples kept as its local test set
    min_size: int = 10  # fewest samples (train + test) a Dirichlet partition gives a client
    partition_seed: int | None = None  # seed of the split (None: the run's seed)
    # a split file (train_idx_K / test_idx_K [/ global_test_idx]); replaces the four above
    partition_file: str | None = None
    eval_every: int = 1  # agents evaluate every N-th training round (and the final step)
    global_eval_every: int = 1  # ... and score the global test set every N-th training round
    export: bool = False
    device: str = "cpu"  # where every simulated agent trains: cpu, cuda[:N] or auto
    profile: FleetProfile | None = None  # slow, distant or flaky devices (coordinator.sim.profile)
    data_root: str | None = None  # torchvision-style datasets read from local files


def agent_will(federation: str, device_id: str) -> Will:
    """Retained ``offline`` status for an agent's last will."""
    return Will(
        Topics(federation).status(device_id),
        encode(Envelope(body=Status(state="offline"), sender=device_id, federation=federation)),
    )


def agent_options(cfg: RunConfig, fleet: FleetSpec, index: int) -> Any:
    """The :class:`~edge_agent.factory.AgentOptions` of simulated device ``index``."""
    from coordinator.strategies import STRATEGIES
    from edge_agent.data import PartitionSpec, parse_partition
    from edge_agent.factory import AgentOptions

    device_id = f"agent{index}"
    spec = PartitionSpec(
        **parse_partition(fleet.partition),
        num_clients=fleet.num_agents,
        seed=cfg.seed if fleet.partition_seed is None else fleet.partition_seed,
        min_size=fleet.min_size,
        test_fraction=fleet.test_fraction,
        global_test_size=fleet.global_test_size,
    )
    run_dir = Path(cfg.run_dir)
    return AgentOptions(
        device_id=device_id,
        algorithm=cfg.algorithm,
        model=fleet.models[index % len(fleet.models)],
        feature_dim=fleet.feature_dim,
        feature_act=fleet.feature_act,
        data=fleet.data,
        image_size=fleet.image_size,
        partition=spec,
        partition_file=None if fleet.partition_file is None else Path(fleet.partition_file),
        client_index=index,
        federation=cfg.federation,
        state_dir=run_dir / "agents" / device_id,
        export_dir=run_dir / "export" / device_id if fleet.export else None,
        device=fleet.device,
        data_root=fleet.data_root,
        seed=cfg.seed,
        eval_every=fleet.eval_every,
        global_eval_every=fleet.global_eval_every,
        classes=cfg.classes,  # what a real agent adopts from the coordinator's state
        class_counts=_registers_counts(cfg, STRATEGIES[cfg.algorithm].needs_class_counts),
    )


def _registers_counts(cfg: RunConfig, needs: bool) -> bool | None:
    """What a simulated agent registers, as a real one learns it from the coordinator's state:
    the histogram where the algorithm reads it; under hyper.dp (None) it waits for that state,
    which carries the budget to noise the histogram by."""
    if not needs:
        return False
    dp_on = bool(getattr(cfg.algorithm_config(), "dp_epsilon", 0.0))
    return None if dp_on else True


class AgentThreads:
    """Simulated agents of this process, each in its own thread over its own transport.

    The in-process backend and each Ray actor (``coordinator.sim.ray_backend``) run their agents
    through this one class, so both build, start and stop them the same way.
    """

    def __init__(
        self,
        cfg: RunConfig,
        fleet: FleetSpec,
        make: TransportFactory,
        *,
        networked: bool = False,
        clock: SimulatedClock | None = None,
    ) -> None:
        """``networked``: ``make`` gives network transports (a thread each), and the GIL switch
        interval grows with the agents started (``gil_slice``) until :meth:`close`. ``clock``:
        the profile's delays are scheduled on it, not slept (every device profiled: without a
        profile, as fast as this host)."""
        from edge_agent.factory import SplitCache

        self.cfg, self.fleet, self.make, self.networked = cfg, fleet, make, networked
        self.clock = clock
        self.splits = SplitCache()  # the fleet's split, computed once for all our agents
        profile = fleet.profile or (FleetProfile() if clock is not None else None)
        self.profiles = None if profile is None else profile.assign(fleet.num_agents, cfg.seed)
        self.stop = threading.Event()
        self.running: list[tuple[Any, Transport, threading.Thread]] = []
        self._switch_interval = sys.getswitchinterval()  # the process's own, back at close

    def start(self, index: int) -> None:
        """Build simulated device ``index``, connect it and run it in a thread."""
        from edge_agent.factory import build_agent

        opts = agent_options(self.cfg, self.fleet, index)
        transport = self.make(opts.device_id, agent_will(self.cfg.federation, opts.device_id))
        if self.profiles is not None:
            transport = ProfiledTransport(
                transport,
                self.profiles[index],
                Topics(self.cfg.federation),
                opts.device_id,
                seed=self.cfg.seed * 7919 + index,
                simulated=self.clock,
            )
        agent = build_agent(opts, transport, splits=self.splits)
        transport.connect()
        agent.start()
        t = threading.Thread(target=agent.run, args=(self.stop,), name=opts.device_id, daemon=True)
        t.start()
        self.running.append((agent, transport, t))
        if self.networked:
            sys.setswitchinterval(gil_slice(len(self.running), self._switch_interval))

    def check_refusals(self, min_agents: int) -> None:
        """Raise once the coordinator refused so many of our agents that ``min_agents`` can no
        longer register: it would wait ``wait_agents_s`` for agents that will never come."""
        refused = [(a.settings.device_id, a.refusal) for a, _, _ in self.running if a.refusal]
        if refused and len(self.running) - len(refused) < min_agents:
            device, reason = refused[0]
            raise ConfigError(
                f"{len(refused)} of {len(self.running)} simulated agents were refused "
                f"({device}: {reason}); the run needs {min_agents}"
            )

    def wait(self) -> list[str]:
        """Block until every agent's run ends; the ids of those that saw the run finish."""
        for _, _, t in self.running:
            t.join()
        return [a.settings.device_id for a, _, _ in self.running if a.finished.is_set()]

    def close(self, timeout: float = 30.0) -> None:
        """Stop the agents and disconnect them."""
        self.stop.set()
        for _, _, t in self.running:
            t.join(timeout=timeout)
        for _, transport, _ in self.running:
            transport.close()
        if self.networked:
            sys.setswitchinterval(self._switch_interval)


def default_family(algorithm: str) -> str:
    """The model family a simulation of ``algorithm`` runs when none is given."""
    from coordinator.strategies import STRATEGIES

    return ONE_ARCHITECTURE_FAMILY if STRATEGIES[algorithm].one_architecture else DEFAULT_FAMILY


def check_fleet(cfg: RunConfig, fleet: FleetSpec) -> None:
    """Refuse, before anything starts, a fleet the run's algorithm would refuse agent by agent
    at registration (a simulation knows its devices; a real fleet is checked as it registers).

    Raises:
        ConfigError: naming what the algorithm needs and the flag that gives it.
    """
    from coordinator.strategies import STRATEGIES

    archs = sorted(set(fleet.models))
    if STRATEGIES[cfg.algorithm].one_architecture and len(archs) > 1:
        raise ConfigError(
            f"{cfg.algorithm} averages whole models, so its fleet must run one architecture, "
            f"this one runs {', '.join(archs)}: give --models one architecture (e.g. --models "
            f"{archs[0]}) or a --family of one (e.g. --family {ONE_ARCHITECTURE_FAMILY})"
        )
    required = cfg.required_feature_dim()
    if required and fleet.feature_dim != required:
        raise ConfigError(
            f"{cfg.algorithm} needs {required}-dimensional features, the fleet's are "
            f"{fleet.feature_dim or 'the native ones'}: leave --feature-dim out or set it to "
            f"{required}"
        )


def simulate(
    cfg: RunConfig,
    fleet: FleetSpec,
    *,
    transport_factory: TransportFactory | None = None,
    logger: logging.Logger | None = None,
    backend: Literal["inprocess", "ray"] = "inprocess",
    ray: RayOptions | None = None,
    observer: RunObserver | None = None,
    clock: SimulatedClock | None = None,
) -> RunResult:
    """Run ``cfg`` with ``fleet.num_agents`` simulated agents; returns the coordinator's result.

    ``backend="inprocess"`` runs the agents in threads of this process; by default all parties
    share one :class:`MemoryBroker`, ``transport_factory(client_id, will) -> Transport`` selects
    a real broker. ``backend="ray"`` runs them in Ray actors over MQTT, set up by ``ray``
    (:class:`~coordinator.sim.ray_backend.RayOptions`). ``observer``: told of the run's events
    in the engine's thread (the in-process backend's; a benchmark reads the thread's CPU time).
    ``clock``: a simulated clock (in-process backend only): the profile's delays are scheduled
    on it instead of slept, and the engine reads its deadlines and timestamps on it.
    """
    check_fleet(cfg, fleet)
    if fleet.partition_file is not None:  # a count mismatch fails before any agent starts
        from edge_agent.data import load_partition_file

        load_partition_file(fleet.partition_file, num_clients=fleet.num_agents)
    if backend == "ray":
        from coordinator.sim.ray_backend import RayOptions, simulate_ray

        if transport_factory is not None:
            raise ConfigError("transport_factory: the Ray backend connects its actors over MQTT")
        if clock is not None:
            raise ConfigError("--clock simulated: only with the in-process backend")
        return simulate_ray(cfg, fleet, ray or RayOptions(), logger=logger)
    if backend != "inprocess":
        raise ConfigError(f"backend: expected 'inprocess' or 'ray', got {backend!r}")
    broker = MemoryBroker()

    def make(client_id: str, will: Will) -> Transport:
        if transport_factory is not None:
            return transport_factory(client_id, will)
        return MemoryTransport(broker, client_id, will=will)

    agents = AgentThreads(cfg, fleet, make, networked=transport_factory is not None, clock=clock)
    coord_transport: Transport | None = None
    try:
        for i in range(fleet.num_agents):
            agents.start(i)
        coord_transport = make("coordinator", coordinator_will(cfg))
        if clock is not None:  # tells the clock which device got a task, which reply came
            coord_transport = clock.watch(coord_transport, Topics(cfg.federation))
        return run_coordinator(
            cfg,
            coord_transport,
            logger,
            health_check=lambda: agents.check_refusals(cfg.min_agents),
            observer=observer,
            clock=clock,
        )
    finally:
        agents.close()
        if coord_transport is not None:
            coord_transport.close()
