"""FedGen edge half: the generated-feature term against a hand-computed value, plain CE before
a generator arrives, the head up."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import edge_algorithm, edge_context

import coordinator.strategies.fedgen.strategy  # noqa: F401  (registers both halves)
from edge_agent.algorithms.fedgen import FedGenEdge, build_generator
from edge_agent.algorithms.weights import module_to_tensormap
from models import create_model
from protocol.algorithms.fedgen import FedGenConfig
from protocol.contract.messages import Task
from protocol.contract.payloads import TensorMap

C, D, NOISE = 3, 4, 5


def make_edge() -> FedGenEdge:
    torch.manual_seed(0)
    y = torch.tensor([0, 1]).repeat(5)
    x = torch.rand(len(y), 1, 8, 8)
    net = create_model("mlp_s", num_classes=C, in_chans=1, feature_dim=D, input_size=8)
    return edge_algorithm("fedgen", FedGenEdge, edge_context(net, x, y, num_classes=C))


def cfg(**changes: object) -> FedGenConfig:
    return FedGenConfig(noise_dim=NOISE, hidden_dim=6, local_epochs=1).replace(**changes)


def task(payloads: dict, phase: str = "train", **changes: object) -> Task:
    return Task(
        task_id="t",
        run_id="r",
        round=2,
        phase=phase,
        deadline=0.0,
        algorithm="fedgen",
        config=cfg(**changes).to_dict(),
        payloads=payloads,
    )


def constant_generator(v: list[float]) -> TensorMap:
    """A generator whose output is ``v`` whatever the noise and label."""
    net = build_generator(NOISE, C, 6, D)
    with torch.no_grad():
        net[3].weight.zero_()
        net[3].bias.copy_(torch.tensor(v))
    return module_to_tensormap(net)


def test_step_loss_adds_the_head_ce_on_generated_features() -> None:
    edge = make_edge()
    head = TensorMap({"weight": np.zeros((C, D)), "bias": np.array([0.0, 1.0, 0.0])})
    payloads = {
        "weights": head,
        "generator": constant_generator([1.0, 2.0, 3.0, 4.0]),
        "labels": TensorMap({"counts": np.array([0, 0, 7])}),  # every sampled label is 2
    }
    edge.handle(task(payloads, phase="final", gen_weight=0.5))  # receive only
    logits, y = torch.tensor([[2.0, 0.0, 1.0]]), torch.tensor([0])
    loss = edge.step_loss(torch.zeros(1), y, torch.zeros(1, D), logits)
    # head(z) = bias = [0, 1, 0] for label 2: CE = log(2 + e)
    expected = F.cross_entropy(logits, y).item() + 0.5 * math.log(2 + math.e)
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_before_a_generator_the_loss_is_plain_ce_and_the_head_goes_up() -> None:
    edge = make_edge()
    edge.cfg = cfg()
    logits, y = torch.tensor([[2.0, 0.0, 1.0]]), torch.tensor([2])
    assert edge.step_loss(torch.zeros(1), y, torch.zeros(1, D), logits).item() == pytest.approx(
        F.cross_entropy(logits, y).item()
    )
    result = edge.handle(task({}))
    up = result.payloads["weights"]
    assert isinstance(up, TensorMap) and up.tensors["weight"].shape == (C, D)
    torch.testing.assert_close(
        torch.as_tensor(up.tensors["bias"]), edge.ctx.model.get_classifier().bias.detach()
    )
