"""FedTGP server half: the adaptive margin and the contrastive loss against hand-computed values,
the generator's prototypes from fake replies, replay after a restart (whole runs:
test_every_algorithm.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import fake_agent
from torch import Tensor, nn

import coordinator.strategies.fedtgp.strategy
import edge_agent.algorithms.fedtgp  # noqa: F401  (registers both halves)
from coordinator.strategies import AgentInfo, ServerContext, Step, create_strategy
from coordinator.strategies.fedtgp.server import acl_loss
from coordinator.strategies.fedtgp.strategy import adaptive_margin
from protocol.algorithms.fedtgp import FedTGPConfig
from protocol.contract.messages import Reply
from protocol.contract.payloads import PrototypeSet
from protocol.errors import ValidationError

C = 4


def agent(device_id: str, classes: list[int]) -> AgentInfo:
    return fake_agent(device_id, "fedtgp", dict.fromkeys(classes, 5), num_classes=C)


def protos(ids: list[int], vecs: list[list[float]]) -> PrototypeSet:
    return PrototypeSet(np.array(ids), np.array(vecs, np.float32), np.full(len(ids), 5, np.int32))


def reply(p: PrototypeSet) -> Reply:
    return Reply(task_id="t", round=1, phase="train", num_samples=10, payloads={"protos": p})


def strategy(**hyper: object) -> coordinator.strategies.fedtgp.strategy.FedTGPStrategy:
    s = create_strategy("fedtgp", FedTGPConfig().replace(**hyper), num_classes=C, seed=0)
    assert isinstance(s, coordinator.strategies.fedtgp.strategy.FedTGPStrategy)
    return s


def test_margin_is_the_largest_nearest_class_gap_capped_by_the_threshold() -> None:
    # gaps: class 0 -> 1 (to class 2), class 1 -> sqrt(18) (to class 2), class 2 -> 1
    means = protos([0, 1, 2], [[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]])
    assert adaptive_margin(means, 100.0) == pytest.approx(math.sqrt(18.0))
    assert adaptive_margin(means, 2.0) == 2.0
    assert adaptive_margin(protos([1], [[1.0, 1.0]]), 7.0) == 7.0  # one class: the threshold


class _Fixed(nn.Module):
    def __init__(self, centers: Tensor) -> None:
        super().__init__()
        self.centers = centers

    def forward(self, ids: Tensor) -> Tensor:
        return self.centers[ids]


def test_acl_loss_adds_the_margin_to_the_own_class_distance() -> None:
    centers = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    batch = (torch.tensor([[0.0, 0.0]]), torch.tensor([0]))
    terms = acl_loss(2, margin=1.0)(_Fixed(centers), batch, torch.Generator())
    # distances [0, 5]; logits -[0 + 1, 5] -> CE = log(1 + e^-4)
    assert terms["loss"].item() == pytest.approx(math.log1p(math.exp(-4.0)), rel=1e-5)


def test_aggregate_keeps_every_client_prototype_and_the_margin_of_their_means() -> None:
    s = strategy()
    a, b = agent("a", [0, 1]), agent("b", [1])
    s.aggregate(
        Step(1, "train"),
        [
            (a, reply(protos([0, 1], [[0.0, 0.0], [2.0, 0.0]]))),
            (b, reply(protos([1], [[4.0, 0.0]]))),
        ],
    )
    assert s._pending is not None
    vectors, labels, pair_weights, margin = s._pending
    assert labels.tolist() == [0, 1, 1] and vectors.shape == (3, 2)
    assert pair_weights.tolist() == [1.0, 1.0, 1.0]
    assert margin == pytest.approx(3.0)  # class means [0, 0] and [3, 0]


def separable_round(
    s: coordinator.strategies.fedtgp.strategy.FedTGPStrategy,
) -> list[tuple[AgentInfo, Reply]]:
    a, b = agent("a", [0, 1]), agent("b", [1, 2])
    return [
        (a, reply(protos([0, 1], [[5.0, 0.0, 0.0], [0.0, 5.0, 0.0]]))),
        (b, reply(protos([1, 2], [[0.0, 4.0, 1.0], [0.0, 0.0, 5.0]]))),
    ]


def test_server_train_generates_separable_prototypes_for_uploaded_classes_only() -> None:
    s = strategy(server_epochs=200, server_lr=0.1)
    replies = separable_round(s)
    s.aggregate(Step(1, "train"), replies)
    metrics = s.server_train(Step(1, "train"), ServerContext.for_step(0, 0, "cpu"))
    assert metrics["tgp_steps"] == 200  # 4 prototypes, batch 10: one step per epoch
    assert s.protos is not None
    assert s.protos.class_ids.tolist() == [0, 1, 2]  # class 3: nobody uploaded it
    assert s.protos.dim == 3
    table = s.protos.vectors
    for _, r in replies:  # every client prototype is nearest to its own class's prototype
        p = r.payloads["protos"]
        assert isinstance(p, PrototypeSet)
        d = ((p.vectors[:, None, :] - table[None]) ** 2).sum(-1)
        assert d.argmin(1).tolist() == [s.protos.class_ids.tolist().index(c) for c in p.class_ids]
    # the next round's tasks carry them; a reply of another dimension is refused
    assert s.configure(Step(2, "train"), agent("a", [0]))["protos"] is s.protos
    with pytest.raises(ValidationError, match="dimension 3"):
        s.validate(Step(2, "train"), agent("a", [0]), reply(protos([0], [[1.0, 1.0]])))


def test_a_replayed_step_trains_the_same_prototypes() -> None:
    first = strategy(server_epochs=5)
    first.aggregate(Step(1, "train"), separable_round(first))
    first.server_train(Step(1, "train"), ServerContext.for_step(3, 0, "cpu"))
    saved = first.state_dict()
    runs = []
    for _ in range(2):
        s = strategy(server_epochs=5)
        s.load_state_dict(saved)
        s.aggregate(Step(2, "train"), separable_round(s))
        s.server_train(Step(2, "train"), ServerContext.for_step(3, 1, "cpu"))
        assert s.protos is not None
        runs.append(s.protos.vectors)
    np.testing.assert_array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], first.protos.vectors if first.protos else None)


def test_acl_loss_weighs_each_pairs_term_by_its_weight() -> None:
    centers = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    x, y = torch.tensor([[0.0, 0.0], [3.0, 4.0]]), torch.tensor([0, 1])
    w = torch.tensor([1.6, 0.4])  # mean 1: a fresh pair and a stale one
    terms = acl_loss(2, margin=1.0)(_Fixed(centers), (x, y, w), torch.Generator())
    # each pair: distances [0, 5] to its own and the other centre -> CE = log(1 + e^-4)
    ce = math.log1p(math.exp(-4.0))
    assert terms["loss"].item() == pytest.approx((1.6 * ce + 0.4 * ce) / 2, rel=1e-5)
    far = torch.tensor([[3.0, 4.0], [3.0, 4.0]])  # pair 0 now sits on the other class's centre
    terms = acl_loss(2, margin=1.0)(_Fixed(centers), (far, y, w), torch.Generator())
    wrong = math.log1p(math.exp(6.0))  # logits [-(5 + 1), -0]
    assert terms["loss"].item() == pytest.approx((1.6 * wrong + 0.4 * ce) / 2, rel=1e-5)


def test_a_stale_replys_prototypes_weigh_its_staleness_weight() -> None:
    s = strategy()
    a, b = agent("a", [0, 1]), agent("b", [1])
    stale = Reply(
        task_id="tb",
        round=1,
        phase="train",
        num_samples=10,
        payloads={"protos": protos([1], [[4.0, 0.0]])},
    )
    s.staleness_weights = {"tb": 0.25}
    s.aggregate(
        Step(3, "train"),
        [(a, reply(protos([0, 1], [[0.0, 0.0], [2.0, 0.0]]))), (b, stale)],
    )
    assert s._pending is not None
    _, labels, pair_weights, margin = s._pending
    assert labels.tolist() == [0, 1, 1]
    assert pair_weights.tolist() == [1.0, 1.0, 0.25]
    # class 1's centre: (2 + 0.25 * 4) / 1.25 = 2.4, its gap to class 0's [0, 0]
    assert margin == pytest.approx(2.4)


def test_the_generator_trains_on_the_pair_weights_normalised_to_mean_one() -> None:
    from coordinator.strategies.fedtgp.server import train_prototypes

    cfg = FedTGPConfig().replace(server_epochs=3)
    x = np.array([[5.0, 0.0], [0.0, 5.0], [0.0, 4.0]], np.float32)
    y = np.array([0, 1, 1])
    ctx = ServerContext.for_step(0, 0, "cpu")

    def train(w: np.ndarray | None) -> np.ndarray:
        return train_prototypes(None, x, y, margin=1.0, num_classes=C, cfg=cfg, ctx=ctx, weights=w)[
            1
        ]

    plain = train(None)
    np.testing.assert_allclose(train(np.full(3, 0.25)), plain, rtol=1e-5)  # all equally stale
    assert not np.allclose(train(np.array([1.0, 1.0, 0.1])), plain)
