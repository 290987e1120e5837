"""Many agents in one process, same code paths as a real fleet (``coordinator simulate``).

Agents run in threads over the in-memory transport by default, or over a real broker when one
is given. Each agent computes its own shard from the shared partition spec, exactly as separate
``edge-agent`` processes do.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

from coordinator.config import RunConfig
from coordinator.engine import RunResult
from coordinator.runner import coordinator_will, run_coordinator
from protocol.codec import Envelope, encode
from protocol.messages import Status
from protocol.topics import Topics
from protocol.transport import MemoryBroker, MemoryTransport, Transport, Will

__all__ = ["FleetSpec", "simulate"]


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
    feature_dim: int | None = 64
    feature_act: str | None = None  # "relu" after the projection
    image_size: int | None = None
    global_test_size: int = 360
    test_fraction: float = 0.2  # share of each client's samples kept as its local test set
    min_size: int = 10  # fewest samples (train + test) a Dirichlet partition gives a client
    partition_seed: int | None = None  # seed of the split (None: the run's seed)
    # a split file (train_idx_K / test_idx_K [/ global_test_idx]); replaces the four above
    partition_file: str | None = None
    eval_every: int = 1  # agents evaluate every N-th training round (and the final step)
    export: bool = False
    device: str = "cpu"  # where every simulated agent trains: cpu, cuda[:N] or auto
    data_root: str | None = None  # torchvision-style datasets read from local files


def agent_will(federation: str, device_id: str) -> Will:
    """Retained ``offline`` status for an agent's last will."""
    return Will(
        Topics(federation).status(device_id),
        encode(Envelope(body=Status(state="offline"), sender=device_id, federation=federation)),
    )


def agent_options(cfg: RunConfig, fleet: FleetSpec, index: int) -> Any:
    """The :class:`~edge_agent.factory.AgentOptions` of simulated device ``index``."""
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
        classes=cfg.classes,  # what a real agent adopts from the coordinator's state
    )


def simulate(
    cfg: RunConfig,
    fleet: FleetSpec,
    *,
    transport_factory: Any = None,
    logger: logging.Logger | None = None,
) -> RunResult:
    """Run ``cfg`` with ``fleet.num_agents`` in-process agents; returns the coordinator's result.

    ``transport_factory(client_id, will) -> Transport`` selects a real broker; by default all
    parties share one :class:`MemoryBroker`.
    """
    from edge_agent.factory import build_agent

    if fleet.partition_file is not None:  # a count mismatch fails before any agent starts
        from edge_agent.data import load_partition_file

        load_partition_file(fleet.partition_file, num_clients=fleet.num_agents)
    broker = MemoryBroker()

    def make(client_id: str, will: Will) -> Transport:
        if transport_factory is not None:
            return transport_factory(client_id, will)  # type: ignore[no-any-return]
        return MemoryTransport(broker, client_id, will=will)

    stop = threading.Event()
    threads: list[threading.Thread] = []
    agents = []
    for i in range(fleet.num_agents):
        opts = agent_options(cfg, fleet, i)
        transport = make(opts.device_id, agent_will(cfg.federation, opts.device_id))
        agent = build_agent(opts, transport)
        transport.connect()
        agent.start()
        agents.append((agent, transport))
        t = threading.Thread(target=agent.run, args=(stop,), name=opts.device_id, daemon=True)
        t.start()
        threads.append(t)
    coord_transport = make("coordinator", coordinator_will(cfg))
    try:
        return run_coordinator(cfg, coord_transport, logger)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        for _, transport in agents:
            transport.close()
        coord_transport.close()
