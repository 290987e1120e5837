"""LG-FedAvg server half with fake replies (the sample-weighted head, layout checks, any
architecture admitted); whole runs: test_every_algorithm.py."""

import numpy as np
import pytest
from helpers import fake_agent

import coordinator.strategies.lg_fedavg  # noqa: F401  (registers the server half)
import edge_agent.algorithms.lg_fedavg  # noqa: F401  (registers the edge half)
from coordinator.strategies import AgentInfo, Step, create_strategy
from protocol.algorithms.lg_fedavg import LGFedAvgConfig
from protocol.contract.messages import Reply
from protocol.contract.payloads import TensorMap
from protocol.errors import ValidationError

C = 3


def agent(device_id: str, arch: str, size: int = 8) -> AgentInfo:
    params = 100 if arch == "mlp_s" else 7
    return fake_agent(
        device_id,
        "lg_fedavg",
        {0: 5, 1: 5},
        num_classes=C,
        arch=arch,
        num_params=params,
        input_spec=(1, size, size),
    )


def head(value: float, dim: int = 2) -> TensorMap:
    return TensorMap(
        {"weight": np.full((C, dim), value, np.float32), "bias": np.full(C, value, np.float32)}
    )


def reply(w: TensorMap, n: int) -> Reply:
    return Reply(task_id="t", round=1, phase="train", num_samples=n, payloads={"weights": w})


def strategy():
    return create_strategy("lg_fedavg", LGFedAvgConfig(), num_classes=C, seed=0)


A, B, X = agent("a", "mlp_s"), agent("b", "cnn_t1"), agent("x", "cnn_t2", size=16)


def test_heads_of_different_architectures_average_by_sample_count() -> None:
    s = strategy()
    s.admit(X, [A, B])  # other extractors, other inputs: all admitted
    step = Step(1, "train")
    replies = [(A, reply(head(1.0), 30)), (B, reply(head(5.0), 10))]
    for a, r in replies:
        s.validate(step, a, r)
    s.aggregate(step, replies)
    sent = s.configure(Step(2, "train"), X)["weights"]
    assert isinstance(sent, TensorMap)
    np.testing.assert_allclose(sent.tensors["weight"], np.full((C, 2), 2.0))  # (30 + 50) / 40
    np.testing.assert_allclose(sent.tensors["bias"], [2.0] * C)
    assert "weights" in s.configure(Step(3, "final", "all"), A)  # the final head too


def test_a_head_of_another_shape_is_left_out_of_round_one_and_refused_after() -> None:
    s = strategy()
    step = Step(1, "train")
    s.validate(step, A, reply(head(1.0), 10))
    s.validate(step, B, reply(head(1.0, dim=4), 10))  # no single upload fixes the layout...
    # ...the layout most uploads share does (a tie: the one that sorts first, here A's)
    metrics = s.aggregate(step, [(A, reply(head(1.0), 10)), (B, reply(head(1.0, dim=4), 10))])
    assert metrics["layout_outliers"] == 1.0
    with pytest.raises(ValidationError, match="global model"):
        s.validate(Step(2, "train"), B, reply(head(1.0, dim=4), 10))
