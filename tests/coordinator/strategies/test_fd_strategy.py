"""FD server half with fake replies (per-class logit means, validation, restart); whole
runs: test_every_algorithm.py."""

import numpy as np
import pytest
from helpers import fake_agent

import coordinator.strategies.fd  # noqa: F401  (registers the server half)
import edge_agent.algorithms.fd  # noqa: F401  (registers the edge half)
from coordinator.strategies import AgentInfo, Step, create_strategy
from protocol.algorithms.fd import FDConfig
from protocol.contract.messages import Reply
from protocol.contract.payloads import PrototypeSet
from protocol.errors import ValidationError

C = 3


def agent(device_id: str, classes: dict[int, int], arch: str = "mlp_s") -> AgentInfo:
    return fake_agent(device_id, "fd", classes, num_classes=C, arch=arch)


def logits(rows: dict[int, list[float]], counts: list[int] | None = None) -> PrototypeSet:
    ids = sorted(rows)
    return PrototypeSet(
        np.array(ids, np.int32),
        np.array([rows[c] for c in ids], np.float32),
        np.array(counts or [5] * len(ids), np.int32),
    )


def reply(payloads: dict, n: int = 10) -> Reply:
    return Reply(task_id="t", round=1, phase="train", num_samples=n, payloads=payloads)


def strategy(**hyper: object):
    return create_strategy("fd", FDConfig.from_dict(dict(hyper)), num_classes=C, seed=0)


A = agent("a", {0: 10, 1: 10})
B = agent("b", {1: 10, 2: 10}, arch="cnn_t1")  # another architecture: logits still average


def test_global_logit_is_the_plain_mean_over_the_holders_of_each_class() -> None:
    s = strategy()
    assert s.configure(Step(1, "train"), A) == {}  # nothing before the first aggregation
    s.aggregate(
        Step(1, "train"),
        [
            (A, reply({"logits": logits({0: [1, 2, 3], 1: [0, 0, 4]})}, n=100)),
            (B, reply({"logits": logits({1: [2, 2, 0], 2: [6, 0, 0]})}, n=10)),
        ],
    )
    sent = s.configure(Step(2, "train"), B)["logits"]
    assert isinstance(sent, PrototypeSet)
    table = sent.as_dict()
    np.testing.assert_allclose(table[0], [1, 2, 3])
    np.testing.assert_allclose(table[1], [1, 1, 2])  # unweighted, whatever the sample counts
    np.testing.assert_allclose(table[2], [6, 0, 0])


@pytest.mark.parametrize(("carry", "kept"), [(False, [1]), (True, [0, 1])])
def test_classes_nobody_held_this_round_drop_out_unless_carried(carry: bool, kept: list) -> None:
    s = strategy(carry_absent=carry)
    s.aggregate(Step(1, "train"), [(A, reply({"logits": logits({0: [1, 0, 0], 1: [0, 1, 0]})}))])
    s.aggregate(Step(2, "train"), [(B, reply({"logits": logits({1: [0, 3, 0]})}))])
    assert s.logits is not None
    assert s.logits.class_ids.tolist() == kept
    np.testing.assert_allclose(s.logits.as_dict()[1], [0, 3, 0])


@pytest.mark.parametrize(
    ("payloads", "field"),
    [
        ({"logits": logits({2: [0, 0, 0]})}, "class_ids"),  # a class a does not hold
        ({"logits": logits({0: [0, 0]})}, "dimension 3"),  # not one logit per class
        ({"logits": logits({0: [0, 0, 0]}, [11])}, "counts"),  # more samples than registered
        ({"logits": logits({0: [0, 0, 0]}, [0])}, "counts"),
        ({}, "prototype set"),
    ],
)
def test_replies_that_do_not_fit_are_refused(payloads: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        strategy().validate(Step(1, "train"), A, reply(payloads))


def test_global_logits_survive_a_restart() -> None:
    s = strategy()
    s.aggregate(Step(1, "train"), [(A, reply({"logits": logits({0: [1, 2, 3]})}))])
    restored = strategy()
    restored.load_state_dict(s.state_dict())
    assert restored.logits is not None
    np.testing.assert_array_equal(restored.logits.vectors, [[1, 2, 3]])
