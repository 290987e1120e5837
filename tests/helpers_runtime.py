"""Small builders shared by runtime tests: in-process agents over the in-memory transport, and
the shipped commands as processes (:class:`Fleet`)."""

from __future__ import annotations

import ast
import dataclasses
import os
import queue
import sqlite3
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from coordinator.config import RunConfig, load_config
from coordinator.engine.core import Coordinator
from coordinator.engine.runner import coordinator_will, make_coordinator
from coordinator.sim.simulate import FleetSpec, agent_options, agent_will
from edge_agent.agent import EdgeAgent
from edge_agent.factory import build_agent
from protocol.algorithms import config_type
from protocol.contract.codec import Envelope, decode
from protocol.contract.messages import Task
from protocol.contract.topics import Topics
from protocol.errors import TransportError
from protocol.security.credentials import ENV
from protocol.transport.base import MemoryBroker, MemoryTransport

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


def train_task(algorithm: str, n: int, **hyper: object) -> Task:
    """Round ``n``'s training task for agent0 of run ``t``, one local epoch, ``hyper`` over the
    algorithm's defaults."""
    cfg = config_type(algorithm)(local_epochs=1, **hyper)  # type: ignore[arg-type]
    return Task(
        task_id=f"t.{n}.0.agent0",
        run_id="t",
        round=n,
        phase="train",
        deadline=1e12,
        algorithm=algorithm,
        config=cfg.task_config(),
    )


def memory_agent(
    tmp_path: Path, broker: MemoryBroker, algorithm: str = "fedproto", **settings: Any
) -> EdgeAgent:
    """:data:`FLEET`'s agent0, started on ``broker`` with its state in ``tmp_path/agent0``."""
    opts = agent_options(run_config(tmp_path, algorithm), FLEET, 0)
    opts = dataclasses.replace(opts, state_dir=tmp_path / "agent0", **settings)
    transport = MemoryTransport(broker, opts.device_id)
    agent = build_agent(opts, transport)
    agent.start()
    transport.connect()
    return agent


def device_uplink(broker: MemoryBroker) -> queue.Queue[Envelope]:
    """Every message the devices send on ``broker``, decoded, as the coordinator receives it."""
    seen: queue.Queue[Envelope] = queue.Queue()
    coord = MemoryTransport(broker, "coordinator")
    coord.connect()
    coord.subscribe(f"{Topics().base}/dev/+/up/#", lambda _t, data: seen.put(decode(data)))
    return seen


def start_coordinator(cfg: RunConfig, broker: MemoryBroker, *, will: bool = True) -> Coordinator:
    """A coordinator on the in-memory broker, connected and started (not yet running); with
    ``will=False`` its death leaves no "offline" state for the agents to see."""
    transport = MemoryTransport(broker, "coordinator", will=coordinator_will(cfg) if will else None)
    coord = make_coordinator(cfg, transport)
    transport.connect()
    coord.start()
    return coord


def crash_and_resume(
    cfg: RunConfig,
    broker: MemoryBroker,
    crash: type[BaseException],
    prepare: Callable[[Coordinator], None] | None = None,
) -> Coordinator:
    """Run a coordinator until ``crash`` (raised by the test's patch) kills it, drop its
    connection without a goodbye and release its store; return its successor on the same run
    directory, connected and started, not yet running.

    ``prepare`` sees the first coordinator before it connects, to patch that instance alone.
    """
    transport = MemoryTransport(broker, "coordinator")
    first = make_coordinator(cfg, transport)
    if prepare is not None:
        prepare(first)
    transport.connect()
    first.start()
    with pytest.raises(crash):
        first.run()
    transport.kill()
    first.store.close()
    return start_coordinator(cfg, broker, will=False)


class InProcessAgent:
    """An agent thread on a memory transport, restartable and killable."""

    def __init__(self, cfg: RunConfig, broker: MemoryBroker, index: int, fleet: FleetSpec = FLEET):
        self.cfg, self.broker, self.index, self.fleet = cfg, broker, index, fleet
        self.opts = agent_options(cfg, fleet, index)
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.agent: EdgeAgent | None = None
        self.transport: MemoryTransport | None = None
        self.killed = False

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
        self.killed = False
        self.thread = threading.Thread(target=self._run, args=(self.agent,), daemon=True)
        self.thread.start()
        return self

    def _run(self, agent: EdgeAgent) -> None:
        try:
            agent.run(self.stop)
        except TransportError:
            if not self.killed:
                raise
            # the power cut caught the agent mid-publish: a killed device just stops

    def kill(self) -> None:
        """Abrupt loss: the broker publishes the last will; the thread stops."""
        assert self.transport is not None and self.thread is not None
        self.killed = True
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


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any ``EDGEFL_*`` credential variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ENV.values()}
    env.update(extra)
    return env


class Fleet:
    """Processes of the shipped commands (``coordinator serve``, ``edge-agent``), each logging
    to ``tmp_path/NAME.log``; :meth:`wait` kills what is still running after 240 s."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        with (self.tmp / f"{name}.log").open("wb") as log:
            self.procs[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait(self) -> dict[str, int]:
        try:
            return {name: p.wait(timeout=240) for name, p in self.procs.items()}
        finally:
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{self.log(n)}" for n in self.procs)


def stored_rows(run_dir: str | Path) -> list[tuple[int, str, str]]:
    """Every stored reply: a done step's have left ``updates`` for ``aggregated``."""
    db = sqlite3.connect(Path(run_dir) / "state.sqlite")
    try:
        return list(
            db.execute(
                "SELECT step, device_id, msg_id FROM updates UNION ALL "
                "SELECT step, device_id, msg_id FROM aggregated ORDER BY step, device_id"
            )
        )
    finally:
        db.close()


def worker_counts(log: Path) -> dict[str, int]:
    """What ``coordinator ingest-worker`` printed when the run finished."""
    line = next(x for x in log.read_text().splitlines() if x.startswith("ingest worker "))
    return dict(ast.literal_eval(line.split(": ", 1)[1]))
