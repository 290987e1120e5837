"""An agent's validation split and the checkpoint of its best round by it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from coordinator.sim.simulate import agent_options
from edge_agent.agent import EdgeAgent
from edge_agent.best_model import BestRound
from edge_agent.data.validation import validation_indices, validation_seed
from edge_agent.factory import build_agent
from models.checkpoint import load_checkpoint
from protocol.algorithms.fedproto import FedProtoConfig
from protocol.contract.codec import Envelope
from protocol.contract.messages import Task
from protocol.transport.base import MemoryBroker, MemoryTransport
from tests.helpers_runtime import FLEET, run_config

LOG = logging.getLogger("test")


def _agent(tmp_path: Path) -> EdgeAgent:
    opts = agent_options(run_config(tmp_path), FLEET, 0)
    transport = MemoryTransport(MemoryBroker(), opts.device_id)
    agent = build_agent(opts, transport)
    transport.connect()
    return agent


def _task(round_: int, fraction: float, run_id: str = "t") -> Task:
    config = FedProtoConfig(local_epochs=1, validation_fraction=fraction)
    return Task(
        task_id=f"{run_id}.{round_}",
        run_id=run_id,
        round=round_,
        phase="train",
        deadline=1e12,
        algorithm="fedproto",
        config=config.to_dict(),
    )


def _run(agent: EdgeAgent, task: Task) -> None:
    agent.on_task(task, Envelope(body=task, sender="coordinator"))


def test_the_agent_trains_without_its_validation_split_and_reports_acc_val(
    tmp_path: Path,
) -> None:
    agent = _agent(tmp_path)
    full = agent.ctx.train
    _run(agent, _task(1, 0.25))
    train, held = validation_indices(full.y.numpy(), 0.25, validation_seed("agent0"))
    assert agent.ctx.validation is not None
    assert torch.equal(agent.ctx.validation.x, full.x[torch.as_tensor(held)])
    assert torch.equal(agent.ctx.train.x, full.x[torch.as_tensor(train)])
    reply = agent.state.pending()[-1][1].body
    assert reply.num_samples == len(train)  # what trained: the validation part never does
    assert 0.0 <= reply.metrics["acc_val"] <= 1.0 and "loss_val" in reply.metrics


def test_without_a_validation_split_there_is_no_acc_val_and_no_best_checkpoint(
    tmp_path: Path,
) -> None:
    agent = _agent(tmp_path)
    _run(agent, _task(1, 0.0))
    assert "acc_val" not in agent.history[-1]
    assert agent.ctx.validation is None
    assert not agent.best.path.exists() and agent.state.checkpoint_path.exists()


def test_the_best_round_is_kept_beside_the_last_and_survives_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = {1: 0.5, 2: 0.8, 3: 0.8, 4: 0.6}  # round 3 only equals round 2
    evaluate = EdgeAgent._evaluate

    def scripted(self: EdgeAgent, task: Task) -> dict[str, float]:
        return {**evaluate(self, task), "acc_val": values[task.round]}

    monkeypatch.setattr(EdgeAgent, "_evaluate", scripted)
    agent = _agent(tmp_path)
    for number in (1, 2, 3):
        _run(agent, _task(number, 0.25))
    best = load_checkpoint(agent.best.path)  # loaded weights_only, like every checkpoint
    assert best.meta["round"] == 2
    assert best.meta["selection"] == {"metric": "acc_val", "value": 0.8}
    assert best.meta["metrics"]["acc_val"] == 0.8
    # a restarted agent compares with the stored best: round 4's 0.6 does not replace it
    again = _agent(tmp_path)
    assert (again.best.round, again.best.value) == (2, 0.8)
    _run(again, _task(4, 0.25))
    assert load_checkpoint(again.best.path).meta["round"] == 2
    assert load_checkpoint(again.state.checkpoint_path).meta["round"] == 4


def test_a_new_run_drops_the_best_round_of_the_last(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    _run(agent, _task(1, 0.25, run_id="first"))
    assert BestRound(agent.state.checkpoint_path, LOG).run_id == "first"
    _run(agent, _task(1, 0.0, run_id="second"))  # no validation split: no best at all
    assert not agent.best.path.exists()
