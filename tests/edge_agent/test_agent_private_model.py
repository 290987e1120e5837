"""FedType's private model stays private even in metadata: the registration names no architecture
and no size (spec §3.3); other algorithms register both (Felo groups by architecture)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from coordinator.sim.simulate import agent_options
from edge_agent.factory import build_agent
from edge_agent.membership import PRIVATE_ARCH
from protocol.contract.messages import Register
from protocol.transport.base import MemoryBroker, MemoryTransport
from tests.helpers_runtime import FLEET, run_config


def registration(tmp_path: Path, algorithm: str) -> Register:
    cfg = run_config(tmp_path, algorithm)
    opts = replace(agent_options(cfg, FLEET, 0), state_dir=tmp_path / algorithm)
    agent = build_agent(opts, MemoryTransport(MemoryBroker(), opts.device_id))
    sent: list[Any] = []
    agent.endpoint.send = lambda topic, body, **kw: sent.append(body)  # type: ignore[method-assign]
    agent.register()
    (reg,) = [b for b in sent if isinstance(b, Register)]
    return reg


def test_fedtype_registers_neither_the_private_architecture_nor_its_size(tmp_path: Path) -> None:
    reg = registration(tmp_path, "fedtype")
    assert reg.arch == PRIVATE_ARCH and reg.num_params == 0
    assert reg.total_samples() > 0  # the rest of the registration is intact


def test_other_algorithms_register_their_architecture(tmp_path: Path) -> None:
    reg = registration(tmp_path, "felo")
    assert reg.arch == FLEET.models[0] and reg.num_params > 0
