"""What an agent discloses at registration: the form the run's state asks for, and nothing
before the state has said which."""

from __future__ import annotations

import dataclasses
import queue
from pathlib import Path

from coordinator.sim.simulate import agent_options
from edge_agent.factory import build_agent
from protocol.contract.codec import Envelope, decode
from protocol.contract.messages import CoordinatorState, Register
from protocol.contract.topics import Topics
from protocol.transport.base import MemoryBroker, MemoryTransport
from tests.helpers_runtime import FLEET, run_config


def _registers(broker: MemoryBroker) -> queue.Queue[Register]:
    seen: queue.Queue[Register] = queue.Queue()
    coord = MemoryTransport(broker, "coordinator")
    coord.connect()

    def keep(_topic: str, data: bytes) -> None:
        env: Envelope = decode(data)
        if isinstance(env.body, Register):
            seen.put(env.body)

    coord.subscribe(f"{Topics().base}/dev/+/up/register", keep)
    return seen


def _state(kind: str, *, class_counts: bool) -> CoordinatorState:
    return CoordinatorState(
        state=kind,
        run_id="t",
        algorithm="fedproto",
        round=1,
        total_rounds=2,
        class_counts=class_counts,
    )


def test_an_agent_registers_once_the_state_says_what_the_run_needs(tmp_path: Path) -> None:
    # Prepare: an agent that joined by its own flags (it has not seen the run's state)
    broker = MemoryBroker()
    registers = _registers(broker)
    opts = dataclasses.replace(agent_options(run_config(tmp_path), FLEET, 0), class_counts=None)
    transport = MemoryTransport(broker, opts.device_id)
    agent = build_agent(opts, transport)
    agent.start()
    transport.connect()
    held = {c: n for c, n in enumerate(agent.ctx.class_counts) if n}
    # Execute + Assert: nothing on connecting; the class set once the run says so
    assert registers.empty()
    agent.on_coordinator_state(_state("running", class_counts=False))
    reg = registers.get(timeout=30)
    assert (reg.class_counts, reg.classes, reg.num_samples) == (
        {},
        sorted(held),
        sum(held.values()),
    )
    agent.on_coordinator_state(_state("running", class_counts=False))  # a repeat: nothing
    assert registers.empty()
    # Execute + Assert: a run reading the histogram gets it, at once
    agent.on_coordinator_state(_state("running", class_counts=True))
    reg = registers.get(timeout=30)
    assert reg.counts_by_class() == held and not reg.classes and not reg.num_samples
    assert registers.empty()
