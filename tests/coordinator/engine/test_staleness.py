"""Staleness weights of buffered mode, its configuration, and the algorithms it refuses."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import fake_agent

from coordinator.config import load_config
from coordinator.engine.staleness import StalenessRule
from coordinator.strategies import Step, create_strategy
from protocol.algorithms import config_type
from protocol.contract.messages import Reply
from protocol.contract.payloads import TensorMap
from protocol.errors import ConfigError


def test_constant_weighs_every_reply_one() -> None:
    rule = StalenessRule("constant")
    assert [rule.weight(s) for s in (0, 1, 5, 50)] == [1.0, 1.0, 1.0, 1.0]


def test_polynomial_is_one_over_one_plus_s_to_the_a() -> None:
    rule = StalenessRule("polynomial", a=0.5)
    assert rule.weight(0) == 1.0
    assert rule.weight(3) == pytest.approx(0.5)  # (1 + 3)^-0.5
    assert rule.weight(8) == pytest.approx(1 / 3)  # (1 + 8)^-0.5
    assert StalenessRule("polynomial", a=1.0).weight(1) == pytest.approx(0.5)


def test_hinge_is_one_up_to_b_then_falls_as_one_over_a_times_the_excess_plus_one() -> None:
    rule = StalenessRule("hinge", a=2.0, b=3.0)
    assert [rule.weight(s) for s in (0, 2, 3)] == [1.0, 1.0, 1.0]
    assert rule.weight(4) == pytest.approx(1 / 3)  # 1 / (2 * 1 + 1)
    assert rule.weight(6) == pytest.approx(1 / 7)  # 1 / (2 * 3 + 1)


def test_a_negative_staleness_is_a_bug() -> None:
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        StalenessRule().weight(-1)


def test_the_bound_refuses_past_max_staleness_with_the_reason() -> None:
    rule = StalenessRule(max_staleness=2)
    assert rule.refusal(2, 1, 3) is None
    why = rule.refusal(3, 1, 4)
    assert why is not None and "staleness 3 > run.max_staleness 2" in why and "round 1" in why


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("mode", "async", "mode one of sync, buffered"),
        ("buffer_size", 0, "buffer_size >= 1"),
        ("staleness", "linear", "run.staleness: expected one of constant, polynomial, hinge"),
        ("staleness_a", -1.0, "staleness_a >= 0"),
        ("max_staleness", -1, "max_staleness >= 0"),
    ],
)
def test_bad_buffered_settings_are_config_errors(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [], **{key: value})


def test_buffered_mode_refuses_ingest_workers() -> None:
    with pytest.raises(ConfigError, match="ingest workers judge replies"):
        load_config(None, [], mode="buffered", ingest_workers=2)


@pytest.mark.parametrize("algorithm", ["fedvtc", "local"])
def test_an_algorithm_that_cannot_run_buffered_is_refused_by_its_config_with_the_reason(
    algorithm: str,
) -> None:
    with pytest.raises(ConfigError, match=f"{algorithm} cannot run buffered: .+run.mode = sync"):
        load_config(None, [], algorithm=algorithm, mode="buffered")
    load_config(None, [], algorithm=algorithm, mode="sync")  # the same algorithm runs sync


@pytest.mark.parametrize(
    "algorithm",
    [
        "fedavg",
        "lg_fedavg",
        "fml",
        "fedkd",
        "fedproto",
        "fd",
        "felo",
        "fedhe",
        "velo",
        "fedtgp",
        "fedktl",
    ],
)
def test_the_algorithms_that_fold_stale_replies_declare_it(algorithm: str) -> None:
    cfg = config_type(algorithm)()
    assert create_strategy(algorithm, cfg, num_classes=10).stale_replies == "weighted"


def test_fedavg_multiplies_the_sample_weight_by_the_staleness_weight() -> None:
    strategy = create_strategy("fedavg", config_type("fedavg")(), num_classes=4)
    agents = [fake_agent(d, "fedavg", {0: 10}) for d in ("a", "b")]
    replies = [
        Reply(
            task_id=f"t{i}",
            round=1,
            phase="train",
            num_samples=10,
            payloads={"weights": TensorMap({"w": np.full(3, v, np.float32)})},
        )
        for i, v in enumerate((2.0, 4.0))
    ]
    strategy.staleness_weights = {"t1": 0.25}  # b's reply is stale
    strategy.aggregate(Step(2, "train"), list(zip(agents, replies, strict=True)))
    assert strategy.weights is not None
    expected = (10 * 2.0 + 10 * 0.25 * 4.0) / (10 + 10 * 0.25)
    np.testing.assert_allclose(strategy.weights.tensors["w"], expected, rtol=1e-6)
