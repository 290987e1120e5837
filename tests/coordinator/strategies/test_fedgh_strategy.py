"""FedGH server half: one SGD step of the global head by hand from fake replies, validation
against the head's input size (whole runs: test_every_algorithm.py)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import fake_agent

import coordinator.strategies.fedgh
import edge_agent.algorithms.fedgh  # noqa: F401  (registers both halves)
from coordinator.strategies import AgentInfo, ServerContext, Step, create_strategy
from protocol.algorithms.fedgh import FedGHConfig
from protocol.contract.messages import Reply
from protocol.contract.payloads import PrototypeSet, TensorMap
from protocol.errors import AggregationError, ValidationError

C = 2


def agent(device_id: str, classes: list[int]) -> AgentInfo:
    return fake_agent(device_id, "fedgh", dict.fromkeys(classes, 5), num_classes=C)


def protos(ids: list[int], vecs: list[list[float]]) -> PrototypeSet:
    return PrototypeSet(np.array(ids), np.array(vecs, np.float32), np.full(len(ids), 5, np.int32))


def reply(p: PrototypeSet) -> Reply:
    return Reply(task_id="t", round=1, phase="train", num_samples=10, payloads={"protos": p})


def strategy(**hyper: object) -> coordinator.strategies.fedgh.FedGHStrategy:
    s = create_strategy("fedgh", FedGHConfig().replace(**hyper), num_classes=C, seed=0)
    assert isinstance(s, coordinator.strategies.fedgh.FedGHStrategy)
    return s


A, B = agent("a", [0]), agent("b", [1])


def test_one_sgd_step_of_the_head_on_the_uploaded_prototypes() -> None:
    # Prepare: a zero head, one prototype per agent, one step (batch >= 2 pairs)
    s = strategy(server_lr=0.1)
    s.load_state_dict({"head": TensorMap({"weight": np.zeros((C, 2)), "bias": np.zeros(C)})})
    # Execute
    s.aggregate(
        Step(1, "train"),
        [(A, reply(protos([0], [[1.0, 0.0]]))), (B, reply(protos([1], [[0.0, 2.0]])))],
    )
    metrics = s.server_train(Step(1, "train"), ServerContext.for_step(0, 0, "cpu"))
    # Assert: softmax 1/2 each; grad W = mean_i (p_i - onehot_i) x_i^T = [[-.25, .5], [.25, -.5]]
    assert metrics["head_steps"] == 1
    assert s.head is not None
    np.testing.assert_allclose(
        s.head.tensors["weight"], [[0.025, -0.05], [-0.025, 0.05]], atol=1e-7
    )
    np.testing.assert_allclose(s.head.tensors["bias"], [0.0, 0.0], atol=1e-7)
    sent = s.configure(Step(2, "train"), A)["weights"]
    assert sent is s.head


def test_first_head_is_seeded_and_replies_must_fit_it() -> None:
    heads = []
    for _ in range(2):
        s = strategy()
        s.aggregate(
            Step(1, "train"),
            [
                (A, reply(protos([0], [[1.0, 0.0, 1.0]]))),
                (B, reply(protos([1], [[0.0, 1.0, 0.0]]))),
            ],
        )
        s.server_train(Step(1, "train"), ServerContext.for_step(5, 0, "cpu"))
        assert s.head is not None and s.head.tensors["weight"].shape == (C, 3)
        heads.append(s.head.tensors["weight"])
    np.testing.assert_array_equal(heads[0], heads[1])
    with pytest.raises(ValidationError, match="dimension 3"):
        s.validate(Step(2, "train"), A, reply(protos([0], [[1.0, 1.0]])))
    with pytest.raises(ValidationError, match="classes the agent registered"):
        s.validate(Step(2, "train"), A, reply(protos([1], [[1.0, 1.0, 1.0]])))


def test_prototypes_of_different_sizes_in_one_round_fail_the_aggregation() -> None:
    s = strategy()
    with pytest.raises(AggregationError, match="dimensions differ"):
        s.aggregate(
            Step(1, "train"),
            [(A, reply(protos([0], [[1.0]]))), (B, reply(protos([1], [[1.0, 2.0]])))],
        )


def test_a_stale_replys_prototypes_weigh_its_staleness_weight_in_the_heads_loss() -> None:
    # Prepare: as above, b's reply answers a task two versions old (staleness weight 0.25)
    s = strategy(server_lr=0.1)
    s.load_state_dict({"head": TensorMap({"weight": np.zeros((C, 2)), "bias": np.zeros(C)})})
    stale = Reply(
        task_id="tb",
        round=1,
        phase="train",
        num_samples=10,
        payloads={"protos": protos([1], [[0.0, 2.0]])},
    )
    s.staleness_weights = {"tb": 0.25}
    # Execute
    s.aggregate(Step(3, "train"), [(A, reply(protos([0], [[1.0, 0.0]]))), (B, stale)])
    s.server_train(Step(3, "train"), ServerContext.for_step(0, 2, "cpu"))
    # Assert: weights [1, 0.25] / their mean 0.625 = [1.6, 0.4]; grad W = mean_i w_i (p_i -
    # onehot_i) x_i^T = [[-.4, .2], [.4, -.2]], grad b = [-.3, .3]; one step of lr 0.1
    assert s.head is not None
    np.testing.assert_allclose(s.head.tensors["weight"], [[0.04, -0.02], [-0.04, 0.02]], atol=1e-7)
    np.testing.assert_allclose(s.head.tensors["bias"], [0.03, -0.03], atol=1e-7)
