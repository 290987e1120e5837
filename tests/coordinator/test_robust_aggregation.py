"""Robust aggregation: median, trimmed mean and norm clipping, by hand and against
one poisoning upload, and their plumbing into the strategies through ``AveragingConfig``."""

import numpy as np
import pytest
from helpers import fake_agent

from coordinator.aggregation import (
    MEAN,
    RobustRule,
    aggregate_maps,
    reduce_by_class,
    reduce_rows,
    screen_by_class,
    weighted_mean,
)
from coordinator.class_stats import mean_prototypes
from coordinator.strategies import AgentInfo, Step, create_strategy
from coordinator.strategies.felo.strategy import robust_means
from coordinator.strategies.felo.table import KnowledgeTable
from protocol.algorithms import config_type
from protocol.contract.messages import Reply
from protocol.contract.payloads import FeatureLogitSet, PrototypeSet, TensorMap
from protocol.contract.validate import MAX_ABS_FEATURE
from protocol.errors import AggregationError, ConfigError

MEDIAN = RobustRule("median")
TRIM = RobustRule("trimmed_mean", trim_fraction=0.25)
COLUMN = [[1.0], [2.0], [3.0], [100.0]]


# ----- the reducers, by hand -------------------------------------------------------------------
def test_median_and_trimmed_mean_of_one_column() -> None:
    assert reduce_rows(COLUMN, MEAN).tolist() == [26.5]
    assert reduce_rows(COLUMN, MEDIAN).tolist() == [2.5]  # (2 + 3) / 2
    assert reduce_rows(COLUMN, TRIM).tolist() == [2.5]  # k = 1: 1 and 100 dropped


def test_trimmed_mean_weighs_the_kept_values_and_median_ignores_weights() -> None:
    w = [1, 1, 3, 1]
    assert reduce_rows(COLUMN, TRIM, w).tolist() == [2.75]  # (1*2 + 3*3) / 4
    assert reduce_rows(COLUMN, MEDIAN, [1, 1, 1, 100]).tolist() == [2.5]
    assert reduce_rows(COLUMN, MEAN, w).tolist() == pytest.approx([(1 + 2 + 9 + 100) / 6])


def test_trimming_is_per_coordinate() -> None:
    rows = [[1.0, 40.0], [2.0, 10.0], [3.0, 20.0], [100.0, 30.0]]
    np.testing.assert_array_equal(reduce_rows(rows, TRIM), [2.5, 25.0])  # (20 + 30) / 2
    np.testing.assert_array_equal(reduce_rows(rows, MEDIAN), [2.5, 25.0])


@pytest.mark.parametrize(
    ("n", "fraction", "expected"),
    [
        (10, 0.1, 1),  # k = ceil(0.1 * 10) = 1 at each end
        (7, 0.1, 1),  # ceil: a class with 7 holders still loses one value at each end
        (10, 0.3, 3),  # 0.3 * 10 is 3.0000000000000004 in floating point: still 3
        (100, 0.29, 29),  # 28.999999999999996: 29
        (3, 0.49, 1),  # at most (n - 1) // 2: the median remains
        (2, 0.4, 0),  # too few uploads to trim: the mean
        (10, 0.0, 0),  # no trimming: the mean
    ],
)
def test_how_many_values_the_trimmed_mean_drops(n: int, fraction: float, expected: int) -> None:
    # ranks 0..n-1 with one huge value at the top: the result shows how many were dropped
    rows = [[float(i)] for i in range(n - 1)] + [[1e6]]
    kept = [float(i) for i in range(n - 1)] + [1e6]
    kept = sorted(kept)[expected : n - expected]
    out = reduce_rows(rows, RobustRule("trimmed_mean", trim_fraction=fraction))
    assert out.tolist() == pytest.approx([sum(kept) / len(kept)])


def test_clipping_bounds_each_deviation_from_the_median() -> None:
    # centre 2; deviations -2 -1 0 1 98; median norm 1; bound 2 x 1: the 98 becomes 2
    rows = [[0.0], [1.0], [2.0], [3.0], [100.0]]
    clip = RobustRule("mean", clip_norm=2.0)
    assert reduce_rows(rows, MEAN).tolist() == pytest.approx([21.2])
    assert reduce_rows(rows, clip).tolist() == pytest.approx([(0 + 1 + 2 + 3 + 4) / 5])
    # the norm is the row's: (30, 40) is 50 away from the centre (0, 0), bound 2 x 1
    rows2 = [[0.0, 0.0], [1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [30.0, 40.0]]
    out = reduce_rows(rows2, clip)
    np.testing.assert_allclose(out, [(0 + 1 - 1 + 0 + 1.2) / 5, (0 + 0 + 0 + 1 + 1.6) / 5])


def test_reduce_by_class_uses_only_the_holders_of_each_class() -> None:
    ids = [0, 0, 0, 1, 1]
    vectors = [[1.0], [2.0], [90.0], [5.0], [7.0]]
    classes, table = reduce_by_class(ids, vectors, MEDIAN)
    assert classes.tolist() == [0, 1]
    assert table.tolist() == [[2.0], [6.0]]


def test_bad_weights_are_refused() -> None:
    with pytest.raises(AggregationError, match="non-negative weights"):
        reduce_rows(COLUMN, TRIM, [1, 1, -1, 1])


# ----- tensor maps ---------------------------------------------------------------------------
def tm(w: float, tracked: int, bias: float = 0.0) -> TensorMap:
    return TensorMap(
        {
            "fc.weight": np.full((2, 2), w, np.float32),
            "fc.bias": np.full(2, bias, np.float32),
            "bn.num_batches_tracked": np.array(tracked, np.int64),
        }
    )


def test_the_plain_rule_is_weighted_mean_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    maps = [TensorMap({"w": rng.standard_normal((3, 4)).astype(np.float32)}) for _ in range(5)]
    for weights in (None, [3, 1, 4, 1, 5]):
        ours = aggregate_maps(maps, weights, MEAN).tensors["w"]
        np.testing.assert_array_equal(ours, weighted_mean(maps, weights).tensors["w"])


def test_median_of_maps_and_the_lower_median_of_integer_buffers() -> None:
    maps = [tm(1.0, 5), tm(2.0, 7), tm(1e6, 10**9)]
    out = aggregate_maps(maps, [1, 1, 100], MEDIAN)
    np.testing.assert_array_equal(out.tensors["fc.weight"], np.full((2, 2), 2.0, np.float32))
    assert int(out.tensors["bn.num_batches_tracked"]) == 7  # the mean path takes the max
    assert int(weighted_mean(maps).tensors["bn.num_batches_tracked"]) == 10**9


def test_clipping_measures_one_norm_over_all_tensors_of_an_upload() -> None:
    # centre: weight 0, bias 0; deviation norms: 0, 2 (4 entries of 1), 2 (2 entries of sqrt2),
    # and 4 * 3 = 12 for the attacker. Median norm 2, bound 1 x 2: the attacker is scaled by 1/6
    maps = [tm(0.0, 1), tm(1.0, 1), tm(0.0, 1, bias=2**0.5), tm(-6.0, 1, bias=0.0)]
    out = aggregate_maps(maps, None, RobustRule("mean", clip_norm=1.0))
    np.testing.assert_allclose(out.tensors["fc.weight"], np.full((2, 2), (1 - 1) / 4), atol=1e-7)
    np.testing.assert_allclose(out.tensors["fc.bias"], np.full(2, 2**0.5 / 4), atol=1e-7)


def test_inconsistent_maps_are_refused_under_robust_rules_too() -> None:
    other = TensorMap({"x": np.zeros(2, np.float32)})
    with pytest.raises(AggregationError, match="different tensor names"):
        aggregate_maps([tm(1, 1), other], None, MEDIAN)


# ----- one poisoning upload ------------------------------------------------------------------
def honest(n: int = 9, dim: int = 32) -> np.ndarray:
    return np.random.default_rng(1).normal(0.5, 1.0, (n, dim))


@pytest.mark.parametrize(
    "attack",
    [
        lambda h: np.full(h.shape[1], MAX_ABS_FEATURE),  # at the value bound
        lambda h: -100.0 * h.mean(axis=0),  # sign-flipped and scaled
    ],
    ids=["at_bound", "sign_flip"],
)
@pytest.mark.parametrize(
    "rule", [MEDIAN, RobustRule("trimmed_mean", trim_fraction=0.1)], ids=["median", "trimmed"]
)
def test_one_poisoner_moves_median_and_trimmed_mean_by_at_most_the_honest_spread(
    attack, rule: RobustRule
) -> None:
    h = honest()
    poisoned = np.vstack([h, attack(h)])
    spread = h.max(axis=0) - h.min(axis=0)
    moved = np.abs(reduce_rows(poisoned, rule) - reduce_rows(h, rule))
    assert np.all(moved <= spread)
    # and the plain mean is not protected: the same upload moves it far beyond the spread
    assert np.any(np.abs(reduce_rows(poisoned, MEAN) - h.mean(axis=0)) > spread)


def test_one_poisoner_moves_the_clipped_mean_by_at_most_its_share_of_the_bound() -> None:
    h = honest()
    poisoned = np.vstack([h, np.full(h.shape[1], MAX_ABS_FEATURE)])
    rule = RobustRule("mean", clip_norm=1.0)
    center = np.median(poisoned, axis=0)
    bound = np.median(np.linalg.norm(poisoned - center, axis=1))
    # honest rows move only when clipped themselves (toward the centre, within the bound)
    pulled = reduce_rows(poisoned, rule) - reduce_rows(poisoned[:-1], RobustRule("mean"))
    assert np.linalg.norm(pulled) <= 2 * bound  # vs |1e4| x sqrt(32) / 10 for the mean
    assert np.linalg.norm(reduce_rows(poisoned, MEAN) - h.mean(axis=0)) > 100 * bound


# ----- config and strategies -----------------------------------------------------------------
def agent(device_id: str, classes: dict[int, int], algorithm: str) -> AgentInfo:
    return fake_agent(device_id, algorithm, classes)


def reply(payloads: dict, n: int = 10) -> Reply:
    return Reply(task_id="t", round=1, phase="train", num_samples=n, payloads=payloads)


def strategy(name: str, **hyper: object):
    return create_strategy(name, config_type(name).from_dict(hyper), num_classes=4)


@pytest.mark.parametrize(
    ("hyper", "key"),
    [
        ({"aggregation": "krum"}, "aggregation"),
        ({"trim_fraction": 0.5}, "trim_fraction"),
        ({"clip_norm": -1.0}, "clip_norm"),
    ],
)
def test_robust_settings_are_checked(hyper: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        config_type("fedavg").from_dict(hyper, where="run.hyper")


@pytest.mark.parametrize(
    "name",
    [
        *("fedavg", "fedproto", "fedvtc", "felo", "velo", "fedhe", "fd", "fedtype"),
        *("lg_fedavg", "fml", "fedkd", "fedtgp", "fedgen", "ccvr"),
    ],
)
def test_every_averaging_algorithm_takes_the_option(name: str) -> None:
    s = strategy(name, aggregation="trimmed_mean", trim_fraction=0.2, clip_norm=3.0)
    assert s.robust == RobustRule("trimmed_mean", 0.2, 3.0)
    assert strategy(name).robust.plain  # the default: the algorithm's own mean


def test_algorithms_that_average_nothing_do_not_accept_it() -> None:
    for name in ("local", "fedktl", "fedgh"):
        with pytest.raises(ConfigError, match="unknown key"):
            config_type(name).from_dict({"aggregation": "median"})


def weights_reply(value: float, n: int = 10) -> Reply:
    return reply({"weights": TensorMap({"w": np.full(3, value, np.float32)})}, n)


@pytest.mark.parametrize("name", ["fedavg", "fedtype", "lg_fedavg", "fml"])
def test_weight_averaging_strategies_resist_one_poisoned_model(name: str) -> None:
    replies = [(agent(f"a{i}", {0: 5}, name), weights_reply(v)) for i, v in enumerate([1, 2, 3])]
    # the poisoner also claims many samples: the sample-weighted mean follows it
    replies.append((agent("evil", {0: 5}, name), weights_reply(1e6, n=10_000)))
    step = Step(1, "train")
    plain, robust = strategy(name), strategy(name, aggregation="median")
    plain.aggregate(step, replies)
    robust.aggregate(step, replies)
    assert plain.weights is not None and plain.weights.tensors["w"][0] > 1e5
    assert robust.weights is not None
    np.testing.assert_array_equal(robust.weights.tensors["w"], [2.5] * 3)


def protoset(ids: list[int], vecs: list[list[float]]) -> PrototypeSet:
    return PrototypeSet(np.array(ids), np.array(vecs, np.float32), np.ones(len(ids), np.int32))


def test_fedproto_reduces_each_class_over_its_holders() -> None:
    sets = [
        protoset([0, 1], [[1.0, 1.0], [5.0, 5.0]]),
        protoset([0], [[2.0, 2.0]]),
        protoset([0, 1], [[3.0, 3.0], [7.0, 7.0]]),
        protoset([0, 1], [[-1e4, 1e4], [1e4, 1e4]]),  # the poisoner, at the value bound
    ]
    replies = [
        (agent(f"a{i}", {0: 5, 1: 5}, "fedproto"), reply({"protos": s})) for i, s in enumerate(sets)
    ]
    s = strategy("fedproto", aggregation="median")
    s.aggregate(Step(1, "train"), replies)
    assert s.protos is not None
    assert s.protos.as_dict()[0].tolist() == [1.5, 2.5]  # median of 4: (1, 2, 3, -1e4) / ...
    assert s.protos.as_dict()[1].tolist() == [7.0, 7.0]  # median of (5, 7, 1e4)
    # FedVTC and FD share the rule (mean_prototypes)
    out = mean_prototypes(None, sets, 4, rule=TRIM)
    assert out is not None
    assert out.as_dict()[0].tolist() == [1.5, 2.5]  # k = 1: (1, 2) and (2, 3) kept
    assert out.counts.tolist() == [4, 3]  # counts are still summed over the holders


def test_fedvtc_reduces_the_sigma_vectors_too() -> None:
    sds = [[1.0, 1.0], [2.0, 2.0], [1e4, 1e4]]
    replies = [
        (
            agent(f"a{i}", {0: 5}, "fedvtc"),
            reply(
                {
                    "protos": PrototypeSet(
                        np.array([0]),
                        np.ones((1, 2), np.float32),
                        np.ones(1, np.int32),
                        sd=np.array(sd, np.float32),
                    )
                }
            ),
        )
        for i, sd in enumerate(sds)
    ]
    s = strategy("fedvtc", aggregation="median")
    s.aggregate(Step(1, "train"), replies)
    assert s.protos is not None and s.protos.sd is not None
    assert s.protos.sd.tolist() == [2.0, 2.0]


def test_felo_knowledge_means_under_a_robust_rule() -> None:
    table = KnowledgeTable(num_classes=4)

    def upload(value: float, cls: list[int]) -> FeatureLogitSet:
        m = len(cls)
        return FeatureLogitSet(
            np.array(cls),
            np.full((m, 2), value, np.float32),
            np.full((m, 4), value, np.float32),
            np.full(m, 3, np.int32),
        )

    table.add(1, [("a", upload(1.0, [0, 1])), ("b", upload(2.0, [0])), ("c", upload(3.0, [0]))])
    table.add(1, [("evil", upload(1e4, [0, 1]))])
    plain = table.means()
    robust = robust_means(table, MEDIAN, "raw")
    assert plain is not None and robust is not None
    assert plain.features[0, 0] > 2000  # mean of (1, 2, 3, 1e4)
    assert robust.class_ids.tolist() == [0, 1]
    assert robust.features[:, 0].tolist() == [2.5, 5000.5]  # class 1: two holders, one honest
    assert robust.logits[0].tolist() == [2.5] * 4
    assert robust.counts.tolist() == [12, 6]
    # through the strategy once warm-up is over
    s = strategy("felo", aggregation="median")
    s.table = table
    knowledge = s.server_knowledge()
    assert knowledge is not None and knowledge.features[0, 0] == 2.5


# ----- screening what a server trains on (FedKTL, FedTGP, FedGH) --------------------------------
def test_screening_drops_the_far_outlier_of_a_class_and_judges_no_class_without_a_majority() -> (
    None
):
    ids = [0, 0, 0, 0, 1, 1]
    # class 0: median (1.1, 0); distances 0.1, 0.1, 0.3, 48.9; their median 0.2, bound 0.6
    vecs = [[1.0, 0.0], [1.2, 0.0], [0.8, 0.0], [50.0, 0.0], [1.0, 1.0], [100.0, 100.0]]
    assert screen_by_class(ids, vecs, 3.0).tolist() == [True, True, True, False, True, True]
    assert screen_by_class(ids, vecs, 1.0).tolist() == [True, True, False, False, True, True]
    assert screen_by_class(ids, vecs, 0.0).all()  # off


def unit(x: float, y: float) -> list[float]:
    n = float(np.hypot(x, y))
    return [x / n, y / n]


@pytest.mark.parametrize("name", ["fedktl", "fedtgp", "fedgh"])
def test_servers_that_train_on_uploads_leave_out_what_upload_screen_screens(name: str) -> None:
    # Prepare: three honest agents agree on class 0; the poisoner's prototype points away
    honest = [protoset([0], [unit(1.0, 0.1 * i)]) for i in range(3)]
    sets = [*honest, protoset([0], [unit(-1.0, -0.2)])]
    replies = [(agent(f"a{i}", {0: 5}, name), reply({"protos": p})) for i, p in enumerate(sets)]
    hyper = {"feature_dim": 2} if name == "fedktl" else {}
    plain = strategy(name, **hyper)
    screened = strategy(name, upload_screen=3.0, **hyper)
    # Execute
    plain_metrics = plain.aggregate(Step(1, "train"), replies)
    metrics = screened.aggregate(Step(1, "train"), replies)
    # Assert: without the option nothing is reported or dropped; with it, the poisoner alone
    assert "screened_uploads" not in plain_metrics
    assert metrics["screened_uploads"] == 1.0
    kept = training_vectors(screened)
    assert len(kept) == 3 and all(v[0] > 0.9 for v in kept)
    assert len(training_vectors(plain)) == 4


def training_vectors(s: object) -> list[list[float]]:
    """The vectors a strategy's next ``server_train`` would train on."""
    if hasattr(s, "_uploads"):  # FedKTL
        return [v.tolist() for vectors, *_ in s._uploads for v in vectors]
    pending = s._pending  # type: ignore[attr-defined]  # FedTGP, FedGH
    return [v.tolist() for v in pending[0]]


def test_upload_screen_is_checked() -> None:
    with pytest.raises(ConfigError, match="upload_screen"):
        config_type("fedgh").from_dict({"upload_screen": 0.5})
    with pytest.raises(ConfigError, match="unknown key"):
        config_type("fedproto").from_dict({"upload_screen": 3.0})  # averages; trains on nothing
