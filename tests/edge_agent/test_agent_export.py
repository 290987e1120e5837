"""The agent's final export: its own model, plus each extra model an algorithm asks for."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from coordinator.sim.simulate import agent_options
from edge_agent.factory import build_agent
from protocol.algorithms.fedtype import FedTypeConfig
from protocol.contract.codec import Envelope
from protocol.contract.messages import Task
from protocol.transport.base import MemoryBroker, MemoryTransport
from tests.helpers_runtime import FLEET, run_config


def final_task(**cfg: object) -> Task:
    config = FedTypeConfig().replace(proxy_model="mlp_xs", local_epochs=1, **cfg)
    return Task(
        task_id="t.final",
        run_id="t",
        round=2,
        phase="final",
        deadline=1e12,
        algorithm="fedtype",
        config=config.to_dict(),
    )


@pytest.mark.slow
def test_a_fedtype_agent_with_export_proxy_exports_and_verifies_two_bundles(
    tmp_path: Path,
) -> None:
    # Prepare
    opts = agent_options(run_config(tmp_path, algorithm="fedtype"), FLEET, 0)
    opts = dataclasses.replace(opts, export_dir=tmp_path / "export")
    transport = MemoryTransport(MemoryBroker(), opts.device_id)
    agent = build_agent(opts, transport)
    transport.connect()
    task = final_task(export_proxy=True)
    # Execute
    agent.on_task(task, Envelope(body=task, sender="coordinator"))
    # Assert: the private model's bundle, and the proxy's beside it, both verified
    metrics = agent.history[-1]
    assert metrics["onnx_exported"] == 1.0 and metrics["onnx_verified"] == 1.0
    assert metrics["onnx_proxy_exported"] == 1.0 and metrics["onnx_proxy_verified"] == 1.0
    assert (tmp_path / "export" / "model.onnx").is_file()
    assert (tmp_path / "export" / "proxy" / "model.onnx").is_file()
    assert (tmp_path / "export" / "proxy" / "manifest.json").is_file()
    assert (opts.state_dir / "proxy.ckpt").is_file()


def test_without_export_proxy_fedtype_exports_nothing_extra(tmp_path: Path) -> None:
    opts = agent_options(run_config(tmp_path, algorithm="fedtype"), FLEET, 0)
    agent = build_agent(opts, MemoryTransport(MemoryBroker(), opts.device_id))
    agent.algorithm.handle(final_task())
    assert agent.algorithm.extra_exports() == {}
    agent.algorithm.handle(final_task(export_proxy=True))
    assert set(agent.algorithm.extra_exports()) == {"proxy"}
