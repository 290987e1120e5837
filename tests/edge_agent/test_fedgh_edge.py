"""FedGH edge half: the global head replaces the classifier, the loss is plain cross-entropy,
prototypes go up."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import edge_algorithm, edge_context

import coordinator.strategies.fedgh  # noqa: F401  (registers both halves)
from edge_agent.algorithms.fedgh import FedGHEdge
from models import create_model
from protocol.algorithms.fedgh import FedGHConfig
from protocol.contract.messages import Task
from protocol.contract.payloads import PrototypeSet, TensorMap
from protocol.errors import ValidationError

C, D = 3, 4


def make_edge() -> FedGHEdge:
    torch.manual_seed(0)
    y = torch.tensor([0, 2]).repeat(5)
    x = torch.rand(len(y), 1, 8, 8)
    net = create_model("mlp_s", num_classes=C, in_chans=1, feature_dim=D, input_size=8)
    return edge_algorithm("fedgh", FedGHEdge, edge_context(net, x, y, num_classes=C))


def task(payloads: dict, phase: str = "train", **cfg: object) -> Task:
    return Task(
        task_id="t",
        run_id="r",
        round=2,
        phase=phase,
        deadline=0.0,
        algorithm="fedgh",
        config=FedGHConfig().replace(**cfg).to_dict(),
        payloads=payloads,
    )


def head(value: float) -> TensorMap:
    return TensorMap({"weight": np.full((C, D), value), "bias": np.arange(C, dtype=np.float32)})


def test_the_global_head_replaces_the_classifier_and_the_loss_is_plain_ce() -> None:
    edge = make_edge()
    extractor = [p.detach().clone() for p in edge.ctx.model.extractor_parameters()]
    edge.handle(task({"weights": head(0.5)}, phase="final"))  # receive only, no training
    w = edge.ctx.model.get_classifier().state_dict()
    torch.testing.assert_close(w["weight"], torch.full((C, D), 0.5))
    torch.testing.assert_close(w["bias"], torch.tensor([0.0, 1.0, 2.0]))
    for before, after in zip(extractor, edge.ctx.model.extractor_parameters(), strict=True):
        torch.testing.assert_close(before, after)  # the extractor stays the agent's own
    logits, y = torch.tensor([[2.0, 0.0, 1.0]]), torch.tensor([2])
    loss = edge.step_loss(torch.zeros(1), y, torch.zeros(1, D), logits)
    assert loss.item() == pytest.approx(F.cross_entropy(logits, y).item())


def test_training_uploads_the_prototypes_of_the_local_classes() -> None:
    edge = make_edge()
    result = edge.handle(task({"weights": head(0.1)}, local_epochs=1))
    assert set(result.payloads) == {"protos"}
    p = result.payloads["protos"]
    assert isinstance(p, PrototypeSet)
    assert p.class_ids.tolist() == [0, 2] and p.counts.tolist() == [5, 5] and p.dim == D


def test_a_head_of_another_size_is_refused() -> None:
    edge = make_edge()
    bad = TensorMap({"weight": np.zeros((C, D + 1)), "bias": np.zeros(C)})
    with pytest.raises(ValidationError, match="weight"):
        edge.handle(task({"weights": bad}, phase="final"))
