"""Weight exchange (TensorMap in and out) and the shared initial state of weight averaging."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from edge_agent.algorithms import EdgeContext
from edge_agent.algorithms.fedavg import FedAvgEdge
from edge_agent.data import PartitionSpec
from edge_agent.factory import AgentOptions, build_agent
from edge_agent.trainer import TensorData
from models import Classifier, create_model
from models.seeding import seeded
from protocol.algorithms.fedavg import FedAvgConfig
from protocol.contract.messages import Task
from protocol.transport.base import MemoryBroker, MemoryTransport


def fedavg_task(**cfg: object) -> Task:
    return Task(
        task_id="t",
        run_id="r",
        round=1,
        phase="train",
        deadline=0.0,
        algorithm="fedavg",
        config=FedAvgConfig(local_epochs=0).replace(**cfg).to_dict(),
        payloads={},
    )


def fedavg_edge(model: str, client_index: int) -> FedAvgEdge:
    """A FedAvg client whose model was initialised per client, as the factory does."""

    def build() -> Classifier:
        return create_model(model, num_classes=4, in_chans=1, feature_dim=16, input_size=8)

    with seeded(1009 + client_index):
        net = build()
    data = TensorData(torch.rand(8, 1, 8, 8), torch.arange(4).repeat(2))
    ctx = EdgeContext(
        model=net,
        train=data,
        test=data,
        num_classes=4,
        device=torch.device("cpu"),
        generator=torch.Generator().manual_seed(client_index),
        model_builder=build,
    )
    return FedAvgEdge(ctx)


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([v.detach().float().flatten() for v in module.state_dict().values()])


def test_fedavg_agents_of_one_architecture_start_identical() -> None:
    # Prepare: per-client initial weights differ
    a, b, other = fedavg_edge("cnn_bn3", 0), fedavg_edge("cnn_bn3", 1), fedavg_edge("cnn_t1", 0)
    assert not torch.equal(flat(a.ctx.model), flat(b.ctx.model))
    # Execute: the first training task (no steps) runs the shared initialisation
    for edge in (a, b, other):
        edge.handle(fedavg_task())
    # Assert: one architecture, one start; another architecture, another start
    assert torch.equal(flat(a.ctx.model), flat(b.ctx.model))
    seeds = [e.shared_modules()["model"].seed for e in (a, b, other)]
    assert seeds[0] == seeds[1] != seeds[2]
    fresh = fedavg_edge("cnn_t1", 0).ctx.model
    assert not torch.equal(flat(other.ctx.model), flat(fresh))  # it was re-initialised too


def test_shared_init_runs_once_and_never_after_a_restore() -> None:
    edge = fedavg_edge("cnn_t1", 0)
    edge.handle(fedavg_task())
    with torch.no_grad():
        for p in edge.ctx.model.parameters():
            p.add_(1.0)  # stands for training
    moved = flat(edge.ctx.model)
    edge.handle(fedavg_task())
    assert torch.equal(flat(edge.ctx.model), moved)  # the second round keeps the weights
    restored = fedavg_edge("cnn_t1", 0)
    restored.ctx.model.load_state_dict(edge.ctx.model.state_dict())
    restored.load_extra_state({})  # what the agent does after loading a checkpoint
    restored.handle(fedavg_task())
    assert torch.equal(flat(restored.ctx.model), moved)


def test_factory_gives_fedavg_agents_the_same_initial_model(tmp_path: Path) -> None:
    # Prepare: two devices of one architecture, different client indices
    broker = MemoryBroker()
    part = PartitionSpec(scheme="dirichlet", alpha=1.0, num_clients=2, seed=0)
    agents = []
    for i in range(2):
        opts = AgentOptions(
            device_id=f"d{i}",
            algorithm="fedavg",
            model="cnn_t1",
            feature_dim=16,
            partition=part,
            client_index=i,
            state_dir=tmp_path / f"d{i}",
            device="cpu",
        )
        agents.append(build_agent(opts, MemoryTransport(broker, opts.device_id)))
    a, b = (agent.algorithm for agent in agents)
    assert a.ctx.model_builder is not None
    assert not torch.equal(flat(a.ctx.model), flat(b.ctx.model))
    # Execute
    for alg in (a, b):
        alg.handle(fedavg_task())
    # Assert
    assert torch.equal(flat(a.ctx.model), flat(b.ctx.model))
