"""Small builders shared by runtime tests: in-process agents over the in-memory transport."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from coordinator.config import RunConfig, load_config
from coordinator.simulate import FleetSpec, agent_options, agent_will
from edge_agent.agent import EdgeAgent
from edge_agent.factory import build_agent
from protocol.transport import MemoryBroker, MemoryTransport

FLEET = FleetSpec(
    num_agents=3,
    models=("mlp_s", "cnn_t1", "mlp_m"),
    data="digits",
    partition="dirichlet:1.0",
    feature_dim=16,
    global_test_size=200,
)


def run_config(
    tmp_path: Path, algorithm: str = "fedproto", rounds: int = 2, **run: Any
) -> RunConfig:
    """A small, fast run config."""
    defaults: dict[str, Any] = {"deadline_s": 60.0, "min_agents": 3, "run_id": "t"}
    defaults.update(run)
    return load_config(
        None,
        ["hyper.local_epochs=1"],
        algorithm=algorithm,
        rounds=rounds,
        run_dir=str(tmp_path / "run"),
        **defaults,
    )


class InProcessAgent:
    """An agent thread on a memory transport, restartable and killable."""

    def __init__(self, cfg: RunConfig, broker: MemoryBroker, index: int, fleet: FleetSpec = FLEET):
        self.cfg, self.broker, self.index, self.fleet = cfg, broker, index, fleet
        self.opts = agent_options(cfg, fleet, index)
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.agent: EdgeAgent | None = None
        self.transport: MemoryTransport | None = None

    def start(self) -> InProcessAgent:
        """Build (resuming from the state dir if present), connect and run in a thread."""
        self.stop = threading.Event()
        self.transport = MemoryTransport(
            self.broker,
            self.opts.device_id,
            will=agent_will(self.cfg.federation, self.opts.device_id),
        )
        self.agent = build_agent(self.opts, self.transport)
        self.transport.connect()
        self.agent.start()
        self.thread = threading.Thread(target=self.agent.run, args=(self.stop,), daemon=True)
        self.thread.start()
        return self

    def kill(self) -> None:
        """Abrupt loss: the broker publishes the last will; the thread stops."""
        assert self.transport is not None and self.thread is not None
        self.transport.kill()
        self.stop.set()
        self.thread.join(timeout=30)

    def close(self) -> None:
        """Clean stop."""
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=30)
        if self.transport is not None:
            self.transport.close()


def fedavg_agent_args(index: int, state_dir: Path, clients: int = 2) -> list[str]:
    """``edge-agent`` arguments of a small fedavg device (digits, iid shard ``index``), for the
    runs of the shipped commands (TLS, signing)."""
    return [
        "--algorithm",
        "fedavg",
        "--model",
        "mlp_s",
        "--feature-dim",
        "16",
        "--data",
        "digits",
        "--partition",
        "iid",
        "--clients",
        str(clients),
        "--client-index",
        str(index),
        "--threads",
        "1",
        "--device",
        "cpu",
        "--state-dir",
        str(state_dir),
        "--no-export",
    ]
