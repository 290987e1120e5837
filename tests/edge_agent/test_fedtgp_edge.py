"""FedTGP edge half: FedProto's loss with FedTGP's lambda against a hand-computed value, and
prediction by nearest global prototype by default."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import edge_algorithm, edge_context

import coordinator.strategies.fedtgp.strategy  # noqa: F401  (registers both halves)
from edge_agent.algorithms.fedtgp import FedTGPEdge
from models import create_model
from protocol.algorithms.fedtgp import FedTGPConfig
from protocol.contract.messages import Task
from protocol.contract.payloads import PrototypeSet

C, D = 3, 2


def make_edge() -> FedTGPEdge:
    torch.manual_seed(0)
    y = torch.tensor([0, 1, 2]).repeat(4)
    x = torch.rand(len(y), 1, 8, 8)
    net = create_model("mlp_s", num_classes=C, in_chans=1, feature_dim=D, input_size=8)
    return edge_algorithm("fedtgp", FedTGPEdge, edge_context(net, x, y, num_classes=C))


def task(payloads: dict, phase: str = "train") -> Task:
    return Task(
        task_id="t",
        run_id="r",
        round=2,
        phase=phase,
        deadline=0.0,
        algorithm="fedtgp",
        config=FedTGPConfig(local_epochs=1).to_dict(),
        payloads=payloads,
    )


def test_step_loss_is_ce_plus_lambda_times_mse_to_the_global_prototype() -> None:
    edge = make_edge()
    edge.cfg = FedTGPConfig()
    edge.receive({"protos": PrototypeSet(np.array([0]), np.array([[1.0, 3.0]]), np.array([4]))})
    features = torch.tensor([[0.0, 1.0], [5.0, 5.0]])
    logits = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    y = torch.tensor([0, 1])  # only class 0 has a global prototype
    loss = edge.step_loss(torch.zeros(2), y, features, logits)
    # MSE over the one masked sample: ((0 - 1)^2 + (1 - 3)^2) / 2 = 2.5; lambda = 0.1
    expected = F.cross_entropy(logits, y).item() + 0.1 * 2.5
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_predicts_by_nearest_global_prototype_and_uploads_prototypes() -> None:
    edge = make_edge()
    protos = PrototypeSet(np.arange(C), np.eye(C, D, dtype=np.float32) * 3, np.ones(C, np.int32))
    result = edge.handle(task({"protos": protos}))
    up = result.payloads["protos"]
    assert isinstance(up, PrototypeSet) and up.class_ids.tolist() == [0, 1, 2] and up.dim == D
    x = edge.ctx.test.x[:3]
    feats = edge.ctx.model.forward_features(x)
    expected = -torch.cdist(feats, torch.as_tensor(protos.vectors)).pow(2)
    torch.testing.assert_close(edge.scores(x), expected)
    assert edge.head_spec().type == "prototype"
