"""``coordinator simulate --backend ray``: the simulated agents in Ray actors, over MQTT.

Ray actors live in other processes (on a cluster, on other machines), so they cannot share the
in-process :class:`~protocol.transport.base.MemoryBroker`: each actor runs a block of the fleet's
agents in threads (:class:`~coordinator.sim.simulate.AgentThreads`, as the in-process backend does),
each agent over its own MQTT connection to one broker; the coordinator runs here, in the
driver, over the same broker. The broker is started here (Mosquitto when installed, else the
embedded one) on loopback, which a local Ray instance reaches; a cluster needs ``broker``, an
address every node reaches.

The actors receive plain data only (the run config's JSON form, the fleet's fields, agent
indices, the broker's address) and build everything else themselves from the installed
package, as ``edge-agent`` processes do: every node needs edgefl (and its data) installed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.config import RunConfig, build_config
from coordinator.engine.core import RunResult
from coordinator.sim.simulate import AgentThreads, FleetSpec
from protocol.errors import ConfigError
from protocol.transport.base import Transport, Will

__all__ = ["AgentHost", "RayOptions", "plan_actors", "simulate_ray"]

log = logging.getLogger("edgefl.simulate")

# how long the actors may take to see the run's end once the coordinator is done with it
FINISH_WAIT_S = 60.0
# the local instance's object store: the actors exchange only their arguments and the ids of
# their agents (the models go over MQTT), so a small store spares a shared machine's /dev/shm
LOCAL_OBJECT_STORE_BYTES = 256 * 1024**2
# paho clients one process can hold: 3 sockets each below select()'s 1024, with room to spare
PAHO_AGENTS_PER_PROCESS = 300


@dataclass(frozen=True)
class RayOptions:
    """Where the Ray backend runs and how it packs the fleet into actors."""

    address: str | None = None  # ray.init(address=...): "auto", "ray://HOST:10001"; None: local
    num_cpus: int | None = None  # CPUs of a local instance (None: os.cpu_count())
    agents_per_actor: int | None = None  # None: as many as needed to fit the cluster's CPUs
    actor_cpus: float = 1.0  # Ray num_cpus of each actor
    actor_gpus: float = 0.0  # Ray num_gpus of each actor (its agents then see that GPU)
    broker: str | None = None  # HOST[:PORT] every node reaches; None: start one on loopback
    threads: int = 0  # torch CPU threads in each actor (0: Ray's OMP_NUM_THREADS = actor_cpus)

    def __post_init__(self) -> None:
        if self.agents_per_actor is not None and self.agents_per_actor < 1:
            raise ConfigError(
                f"agents_per_actor: expected an int >= 1, got {self.agents_per_actor}"
            )
        if self.actor_cpus < 0 or self.actor_gpus < 0:
            raise ConfigError(
                f"actor_cpus, actor_gpus: expected values >= 0, got {self.actor_cpus}, "
                f"{self.actor_gpus}"
            )
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ConfigError(f"num_cpus: expected an int >= 1, got {self.num_cpus}")
        if self.threads < 0:
            raise ConfigError(f"threads: expected an int >= 0, got {self.threads}")


def plan_actors(num_agents: int, options: RayOptions, resources: dict[str, float]) -> list[range]:
    """The agent indices of each actor: contiguous blocks of ``agents_per_actor``.

    Every agent must run at once (the coordinator waits for the whole fleet), so all actors
    must fit ``resources`` (Ray's ``cluster_resources()``) together; unset, ``agents_per_actor``
    is the smallest block size that makes them fit.

    Raises:
        ConfigError: the actors cannot all be placed at once.
    """
    slots = num_agents
    for key, need in (("CPU", options.actor_cpus), ("GPU", options.actor_gpus)):
        if need > 0:
            slots = min(slots, int(resources.get(key, 0.0) / need + 1e-9))
    per_actor = options.agents_per_actor or math.ceil(num_agents / max(slots, 1))
    actors = math.ceil(num_agents / per_actor)
    if actors > slots:
        raise ConfigError(
            f"{actors} actors of {options.actor_cpus:g} CPU / {options.actor_gpus:g} GPU each "
            f"({per_actor} agents per actor) do not fit the Ray cluster's "
            f"{resources.get('CPU', 0.0):g} CPU / {resources.get('GPU', 0.0):g} GPU at once: "
            "raise agents_per_actor or lower actor_cpus / actor_gpus"
        )
    return [range(a, min(a + per_actor, num_agents)) for a in range(0, num_agents, per_actor)]


class AgentHost:
    """The body of one Ray actor: a block of the fleet's agents, in threads, over MQTT."""

    def run(
        self,
        cfg_data: dict[str, Any],
        fleet_data: dict[str, Any],
        indices: list[int],
        broker: tuple[str, int],
        threads: int,
    ) -> list[str]:
        """Run agents ``indices`` until the run finishes; the ids of those that saw it end."""
        from protocol.logs import setup_logging

        setup_logging("WARNING", "text")  # the actor's stderr goes to the driver
        from models.cpu_threads import apply_thread_setting

        apply_thread_setting(threads, agents=len(indices))
        cfg = build_config({"run": {}, "hyper": {}}, base=cfg_data)
        fleet = FleetSpec(**{**fleet_data, "models": tuple(fleet_data["models"])})
        host, port = broker

        from coordinator.engine.runner import mqtt_client

        client = mqtt_client(cfg)  # the run's: lean unless run.mqtt_client says paho

        def make(device_id: str, will: Will) -> Transport:
            # the edge-agent CLI's client id: the same device, the same broker session
            client_id = f"edgefl-{cfg.federation}-{device_id}"
            return client(host=host, port=port, client_id=client_id, will=will)

        agents = AgentThreads(cfg, fleet, make, networked=True)
        try:
            for i in indices:
                agents.start(i)
            return agents.wait()
        finally:
            agents.close()

    def where(self) -> dict[str, Any]:
        """The node and process this actor runs in (what the driver logs as its placement)."""
        import socket

        ray = _import_ray()
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }


def simulate_ray(
    cfg: RunConfig,
    fleet: FleetSpec,
    options: RayOptions,
    *,
    logger: logging.Logger | None = None,
) -> RunResult:
    """Run ``cfg`` with the fleet's agents in Ray actors; returns the coordinator's result.

    Uses the Ray instance this process is already connected to, else connects to
    ``options.address``, else starts a local one (and shuts down only what it started).
    """
    ray = _import_ray()
    started = _connect(ray, options)
    try:
        plan = plan_actors(fleet.num_agents, options, ray.cluster_resources())
        _check_client_fits(cfg.mqtt_client, plan)
        if options.broker is None:
            _check_loopback_reaches(ray.nodes(), ray.util.get_node_ip_address())
        with _broker(options) as (host, port):
            return _run(
                ray, cfg, fleet, options=options, plan=plan, broker=(host, port), logger=logger
            )
    finally:
        if started:
            ray.shutdown()


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(
            "the Ray backend needs ray: pip install 'edgefl[ray]' (on every node)"
        ) from exc
    return ray


def _connect(ray: Any, options: RayOptions) -> bool:
    """Connect to Ray unless already connected; whether this call started the connection."""
    if ray.is_initialized():
        return False
    if options.address is not None:
        ray.init(address=options.address, logging_level=logging.WARNING)
    else:
        ray.init(
            num_cpus=options.num_cpus or os.cpu_count(),
            include_dashboard=False,
            logging_level=logging.WARNING,
            object_store_memory=LOCAL_OBJECT_STORE_BYTES,
        )
    return True


@contextlib.contextmanager
def _broker(options: RayOptions) -> Iterator[tuple[str, int]]:
    """The broker's address: the given one, or one started here on loopback."""
    from coordinator.broker.embedded import EmbeddedBroker, MosquittoBroker, mosquitto_executable
    from protocol.transport.address import parse_broker

    if options.broker is not None:
        given = parse_broker(options.broker)
        if given.scheme not in (None, "mqtt"):
            raise ConfigError(
                f"--broker {given}: the Ray simulation's agents and coordinator connect over "
                "plain MQTT on TCP, without credentials; give HOST[:PORT] or mqtt://HOST[:PORT]"
            )
        yield given.host, given.port
        return
    # Mosquitto moves far more messages per second than the embedded (Python) broker
    broker = MosquittoBroker() if mosquitto_executable() else EmbeddedBroker(port=0)
    with broker:
        log.info("MQTT broker (%s) on %s:%d", type(broker).__name__, broker.host, broker.port)
        yield broker.host, broker.port


def _check_client_fits(client: str, plan: list[range]) -> None:
    """Refuse actors with more paho clients than one process can hold.

    paho's network loop uses ``select()``, which takes no socket numbered 1024 or above
    (``FD_SETSIZE``), and each paho client holds 3 (its socket and a wake-up pair): past ~340
    clients in one process, new ones connect but never see their CONNACK and old ones drop
    (paho-mqtt issue #238). The lean client waits with epoll and has no such bound.

    Raises:
        ConfigError: ``run.mqtt_client`` is paho and an actor has more than
            :data:`PAHO_AGENTS_PER_PROCESS` agents.
    """
    most = max(len(block) for block in plan)
    if client == "paho" and most > PAHO_AGENTS_PER_PROCESS:
        raise ConfigError(
            f"run.mqtt_client=paho: an actor of {most} agents would hold {3 * most} sockets, "
            f"and paho's select() loop cannot use those numbered 1024 and up: at most "
            f"{PAHO_AGENTS_PER_PROCESS} agents an actor (--agents-per-actor), or the lean client"
        )


def _check_loopback_reaches(nodes: list[dict[str, Any]], driver_ip: str) -> None:
    """Refuse a broker on loopback when a live node of the cluster is another host.

    ``nodes``: ``ray.nodes()``. Nodes on this host (a local instance, or several raylets on
    one machine) reach 127.0.0.1; an actor elsewhere would only fail to connect, and the run
    would wait ``wait_agents_s`` for agents that never come.

    Raises:
        ConfigError: a live node's address is not the driver's.
    """
    others = sorted({n["NodeManagerAddress"] for n in nodes if n.get("Alive")} - {driver_ip})
    if others:
        raise ConfigError(
            f"the Ray cluster has nodes on other hosts ({', '.join(others)}) than this one "
            f"({driver_ip}), which cannot reach a broker started here on 127.0.0.1: give "
            "--broker HOST[:PORT] that every node reaches"
        )


def _placement(ray: Any, places: list[Any], plan: list[range], *, timeout: float) -> None:
    """Where each actor runs (``places``: its ``where`` calls), logged one line an actor.

    Waits for every actor to start, at most ``timeout`` seconds, so that an actor that cannot
    start fails the run here, with its reason.

    Raises:
        AgentProcessError: an actor failed to start, or not all started within ``timeout``.
    """
    from coordinator.sim.demo import AgentProcessError

    try:
        where: list[dict[str, Any]] = ray.get(places, timeout=timeout)
    except ray.exceptions.GetTimeoutError as exc:
        raise AgentProcessError(
            f"not all of {len(places)} Ray actors started within {timeout:g} s (run.wait_agents_s)"
        ) from exc
    except ray.exceptions.RayError as exc:
        raise _actor_error(ray, exc, "an actor") from exc
    for block, place in zip(plan, where, strict=True):
        log.info(
            "agents %d-%d: Ray node %s (%s, host %s), pid %d",
            block.start,
            block.stop - 1,
            place["node_id"],
            place["ip"],
            place["host"],
            place["pid"],
        )
    log.info(
        "%d agents in %d Ray actors on %d node(s)",
        plan[-1].stop,
        len(where),
        len({p["node_id"] for p in where}),
    )


def _run(
    ray: Any,
    cfg: RunConfig,
    fleet: FleetSpec,
    *,
    options: RayOptions,
    plan: list[range],
    broker: tuple[str, int],
    logger: logging.Logger | None,
) -> RunResult:
    """Start the actors, coordinate the run from here, then let the actors go."""
    from coordinator.engine.runner import mqtt_transport, run_coordinator

    # an absolute run directory: on another node the driver's working directory means nothing
    cfg_data = {**cfg.to_dict(), "run_dir": str(Path(cfg.run_dir).resolve())}
    fleet_data = dataclasses.asdict(fleet)
    host_cls = ray.remote(AgentHost).options(
        num_cpus=options.actor_cpus, num_gpus=options.actor_gpus
    )
    actors = [host_cls.remote() for _ in plan]
    # an actor runs its calls in order: ``where`` answers as soon as the actor is up
    places = [actor.where.remote() for actor in actors]
    pending = {
        actor.run.remote(cfg_data, fleet_data, list(block), broker, options.threads): block
        for actor, block in zip(actors, plan, strict=True)
    }
    finished = False
    transport: Transport | None = None
    try:
        _placement(ray, places, plan, timeout=cfg.wait_agents_s)
        transport = mqtt_transport(cfg, *broker)
        result = run_coordinator(
            cfg, transport, logger, health_check=lambda: _check_actors(ray, pending)
        )
        finished = True
        return result
    finally:
        if transport is not None:
            transport.close()
        if finished and pending:  # the agents saw the run end: time to leave cleanly
            ray.wait(list(pending), num_returns=len(pending), timeout=FINISH_WAIT_S)
        for actor in actors:
            ray.kill(actor)


def _check_actors(ray: Any, pending: dict[Any, range]) -> None:
    """Fail the run at once when an actor failed, instead of waiting out the deadlines.

    ``pending``: each actor's ``run`` call and its agents; it loses the calls that returned, so
    each is looked at once.
    """
    done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
    for ref in done:
        block = pending.pop(ref)
        try:
            ray.get(ref)
        except ray.exceptions.RayError as exc:
            raise _actor_error(ray, exc, f"agents {block.start}-{block.stop - 1}") from exc


def _actor_error(ray: Any, exc: Exception, who: str) -> Exception:
    """The error to end the run with when the actor of ``who`` failed with ``exc``.

    A toolkit error raised in the actor (a bad partition, an unknown model, missing data) is
    the same precise error the in-process backend gives, so it is reported by its message;
    anything else keeps Ray's report, whose traceback is the actor's.
    """
    from coordinator.sim.demo import AgentProcessError
    from protocol.errors import EdgeFLError

    cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else None
    if isinstance(cause, EdgeFLError):
        log.debug("the Ray actor of %s failed: %s", who, exc)
        return AgentProcessError(f"the Ray actor of {who} failed: {cause}")
    return AgentProcessError(f"the Ray actor of {who} failed: {exc}")
