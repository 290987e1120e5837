"""The feature activation knob reaches the model and its checkpoint (Felo's spec §9 asks
for non-negative features like pooled CNN ones)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from coordinator.sim.simulate import agent_options
from edge_agent.factory import build_agent
from models.checkpoint import ModelSpec
from protocol.transport.base import MemoryBroker, MemoryTransport
from tests.helpers_runtime import FLEET, run_config


def test_relu_features_on_the_model_and_in_its_checkpoint_spec(tmp_path: Path) -> None:
    # Prepare: agent 0 of the small test fleet (an MLP: its projection can go negative)
    cfg = run_config(tmp_path)
    fleet = replace(FLEET, feature_act="relu")
    opts = agent_options(cfg, fleet, 0)
    # Execute
    agent = build_agent(opts, MemoryTransport(MemoryBroker(), opts.device_id))
    model = agent.algorithm.ctx.model
    plain = build_agent(
        replace(agent_options(cfg, FLEET, 0), state_dir=tmp_path / "plain"),
        MemoryTransport(MemoryBroker(), "plain"),
    ).algorithm.ctx.model
    x = torch.rand(64, 1, 8, 8)
    # Assert: non-negative with relu, not without; the export rebuilds it from the spec
    assert bool((model.forward_features(x) >= 0).all())
    assert bool((plain.forward_features(x) < 0).any())
    assert ModelSpec.from_model(model).feature_act == "relu"


def test_the_agent_cli_takes_feature_act() -> None:
    from edge_agent.cli import build_parser

    args = build_parser().parse_args(["--broker", "h", "--feature-act", "relu"])
    assert args.feature_act == "relu"
