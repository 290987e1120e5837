"""FedGen server half: the teacher-ensemble loss and the head mean by hand, validation, label
counts and generator sent down, replay, one layout on both halves (whole runs:
test_every_algorithm.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import fake_agent
from torch import Tensor, nn

import coordinator.strategies.fedgen.strategy
import edge_agent.algorithms.fedgen  # registers both halves
from coordinator.strategies import AgentInfo, ServerContext, Step, create_strategy
from coordinator.strategies.fedgen.server import build_generator, ensemble_loss
from protocol.algorithms.fedgen import FedGenConfig
from protocol.contract.messages import Reply
from protocol.contract.payloads import TensorMap
from protocol.errors import ValidationError

C, D = 2, 3


def agent(device_id: str, counts: dict[int, int]) -> AgentInfo:
    return fake_agent(device_id, "fedgen", counts, num_classes=C)


def head(w: float, b: list[float], d: int = D) -> TensorMap:
    return TensorMap({"weight": np.full((C, d), w, np.float32), "bias": np.array(b, np.float32)})


def reply(h: TensorMap, n: int) -> Reply:
    return Reply(task_id="t", round=1, phase="train", num_samples=n, payloads={"weights": h})


def strategy(**hyper: object) -> coordinator.strategies.fedgen.strategy.FedGenStrategy:
    small = {"noise_dim": 4, "hidden_dim": 8, "server_steps": 5, **hyper}
    s = create_strategy("fedgen", FedGenConfig().replace(**small), num_classes=C, seed=0)
    assert isinstance(s, coordinator.strategies.fedgen.strategy.FedGenStrategy)
    return s


A, B = agent("a", {0: 30}), agent("b", {0: 10, 1: 20})


class _Constant(nn.Module):
    def __init__(self, z: Tensor) -> None:
        super().__init__()
        self.z = z

    def forward(self, x: Tensor) -> Tensor:
        return self.z.expand(x.shape[0], -1)


def test_ensemble_loss_is_ce_of_the_weighted_sum_of_head_logits() -> None:
    weights = torch.stack([torch.eye(2), torch.zeros(2, 2)])  # head 1: identity; head 2: zero
    biases = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    mix = torch.tensor([0.5, 0.5])
    loss_fn = ensemble_loss(weights, biases, mix, noise_dim=1, num_classes=2)
    terms = loss_fn(_Constant(torch.tensor([[2.0, 0.0]])), (torch.tensor([1]),), torch.Generator())
    # logits: 0.5 * [2, 0] + 0.5 * [1, 0] = [1.5, 0]; CE for label 1 = log(1 + e^1.5)
    assert terms["loss"].item() == pytest.approx(math.log1p(math.exp(1.5)), rel=1e-6)


def test_heads_are_averaged_by_samples_and_checked() -> None:
    s = strategy()
    s.aggregate(
        Step(1, "train"), [(A, reply(head(1.0, [0, 0]), 30)), (B, reply(head(5.0, [4, 8]), 10))]
    )
    assert s.head is not None
    np.testing.assert_allclose(s.head.tensors["weight"], np.full((C, D), 2.0))  # (30 + 50) / 40
    np.testing.assert_allclose(s.head.tensors["bias"], [1.0, 2.0])
    with pytest.raises(ValidationError, match="shape"):
        s.validate(Step(2, "train"), A, reply(head(1.0, [0, 0], d=D + 1), 5))
    with pytest.raises(ValidationError, match="linear head"):
        s.validate(Step(2, "train"), A, reply(TensorMap({"w": np.zeros(2)}), 5))


def test_a_stale_head_weighs_its_samples_times_its_staleness_weight() -> None:
    s = strategy(head_exchange=True)
    stale = Reply(
        task_id="tb",
        round=1,
        phase="train",
        num_samples=10,
        payloads={"weights": head(5.0, [4, 8])},
    )
    s.staleness_weights = {"tb": 0.5}  # b answers a task three versions old (a = 0.5)
    s.aggregate(Step(4, "train"), [(A, reply(head(1.0, [0, 0]), 30)), (B, stale)])
    assert s.head is not None
    expected = (30 * 1.0 + 0.5 * 10 * 5.0) / (30 + 0.5 * 10)
    np.testing.assert_allclose(s.head.tensors["weight"], np.full((C, D), expected), rtol=1e-6)
    assert s._pending is not None and s._pending[1] == [30.0, 5.0]  # the ensemble's mix


def test_generator_goes_down_with_the_fleet_label_counts_and_replays() -> None:
    runs = []
    for _ in range(2):
        s = strategy()
        for a in (A, B):
            assert s.configure(Step(1, "train"), a) == {}  # nothing trained yet
        s.aggregate(
            Step(1, "train"),
            [(A, reply(head(1.0, [0, 0]), 30)), (B, reply(head(-1.0, [0, 1]), 10))],
        )
        metrics = s.server_train(Step(1, "train"), ServerContext.for_step(1, 0, "cpu"))
        assert metrics["generator_steps"] == 5
        down = s.configure(Step(2, "train"), A)
        assert set(down) == {"generator", "labels", "weights"}
        labels = down["labels"]
        assert isinstance(labels, TensorMap)
        assert labels.tensors["counts"].tolist() == [40, 20]
        assert s.generator is not None
        runs.append(s.generator.tensors)
    for k in runs[0]:
        np.testing.assert_array_equal(runs[0][k], runs[1][k])
    restored = strategy()
    restored.load_state_dict(s.state_dict())
    assert restored.label_counts().tolist() == [40, 20]
    with pytest.raises(ValidationError, match="shape"):
        restored.validate(Step(2, "train"), A, reply(head(1.0, [0, 0], d=D + 2), 5))


def test_both_halves_build_one_generator_layout() -> None:
    server = build_generator(4, C, 8, D).state_dict()
    edge = edge_agent.algorithms.fedgen.build_generator(4, C, 8, D).state_dict()
    assert {k: v.shape for k, v in server.items()} == {k: v.shape for k, v in edge.items()}
