"""Felo/Velo/FedHe server half with fake replies: validation, groups, warm-up, CVAE replay."""

import numpy as np
import pytest
from helpers import fake_agent

from coordinator.strategies import AgentInfo, Step, create_strategy
from coordinator.strategies.base import ServerContext
from coordinator.strategies.felo.strategy import group_key
from protocol.algorithms import config_type
from protocol.contract.messages import Reply
from protocol.contract.payloads import FeatureLogitSet, LabelledVectors, TensorMap
from protocol.errors import ValidationError

C, D = 3, 4


def agent(device_id: str, arch: str, classes: dict[int, int], algorithm: str = "felo") -> AgentInfo:
    return fake_agent(device_id, algorithm, classes, num_classes=C, arch=arch)


def knowledge(ids: list[int], value: float, counts: list[int] | None = None) -> FeatureLogitSet:
    m = len(ids)
    return FeatureLogitSet(
        np.array(ids, np.int32),
        np.full((m, D), value, np.float32),
        np.full((m, C), value, np.float32),
        np.array(counts or [5] * m, np.int32),
    )


def weights(value: float, shape: tuple[int, ...] = (2,)) -> TensorMap:
    return TensorMap({"w": np.full(shape, value, np.float32), "n": np.array(3, np.int64)})


def reply(payloads: dict, n: int = 10, round_: int = 1) -> Reply:
    return Reply(task_id="t", round=round_, phase="train", num_samples=n, payloads=payloads)


def strategy(name: str = "felo", **hyper: object):
    cfg = config_type(name).from_dict(dict(hyper))
    s = create_strategy(name, cfg, num_classes=C, seed=0)
    s.plan(20)  # warm-up = max(1, round(0.05 * 20)) = 1 round
    return s


A = agent("a", "mlp_s", {0: 10, 1: 10})
B = agent("b", "mlp_s", {1: 10, 2: 10})
X = agent("x", "cnn_t1", {0: 10})


def test_groups_average_within_an_architecture_never_across() -> None:
    s = strategy()
    replies = [
        (A, reply({"knowledge": knowledge([0, 1], 1.0), "weights": weights(1.0)}, n=30)),
        (B, reply({"knowledge": knowledge([1, 2], 3.0), "weights": weights(5.0)}, n=10)),
        (X, reply({"knowledge": knowledge([0], 2.0), "weights": weights(9.0, (3,))}, n=10)),
    ]
    s.aggregate(Step(1, "train"), replies)
    np.testing.assert_allclose(s.groups[group_key(A)].tensors["w"], [2.0, 2.0])  # (30+50)/40
    np.testing.assert_allclose(s.groups[group_key(X)].tensors["w"], [9.0] * 3)
    assert group_key(A) == group_key(B) != group_key(X)
    # each agent receives its own group's model
    w_b = s.configure(Step(2, "train"), B)["weights"]
    assert isinstance(w_b, TensorMap)
    np.testing.assert_allclose(w_b.tensors["w"], [2.0, 2.0])


def test_knowledge_is_sent_only_after_warm_up_and_covers_reported_classes() -> None:
    s = strategy()
    s.aggregate(
        Step(1, "train"),
        [(A, reply({"knowledge": knowledge([0, 1], 1.0), "weights": weights(1.0)}))],
    )
    assert "knowledge" not in s.configure(Step(1, "train"), A)  # round 1 is warm-up
    k = s.configure(Step(2, "train"), X)["knowledge"]
    assert isinstance(k, FeatureLogitSet)
    assert k.class_ids.tolist() == [0, 1]  # class 2: nobody reported it, so it is masked


@pytest.mark.parametrize(
    ("payloads", "field"),
    [
        ({"knowledge": knowledge([2], 1.0), "weights": weights(1.0)}, "class_ids"),
        ({"knowledge": knowledge([0], 1.0, [11]), "weights": weights(1.0)}, "counts"),
        ({"knowledge": knowledge([0], 1.0)}, "weights"),
        ({"weights": weights(1.0)}, "knowledge"),
    ],
)
def test_replies_that_do_not_fit_are_refused(payloads: dict, field: str) -> None:
    s = strategy()
    with pytest.raises(ValidationError, match=field):
        s.validate(Step(1, "train"), A, reply(payloads))


def test_weights_must_match_the_group_model_and_features_the_table() -> None:
    s = strategy()
    s.aggregate(
        Step(1, "train"), [(A, reply({"knowledge": knowledge([0], 1.0), "weights": weights(1.0)}))]
    )
    with pytest.raises(ValidationError, match="tensors of group"):
        s.validate(
            Step(2, "train"),
            B,
            reply({"knowledge": knowledge([1], 1.0), "weights": weights(1.0, (5,))}),
        )
    wide = FeatureLogitSet(
        np.array([1], np.int32), np.zeros((1, D + 1)), np.zeros((1, C)), np.array([1], np.int32)
    )
    with pytest.raises(ValidationError, match="dimension 4"):
        s.validate(Step(2, "train"), B, reply({"knowledge": wide, "weights": weights(1.0)}))
    # a different architecture starts its own group: any layout is accepted
    s.validate(
        Step(2, "train"),
        X,
        reply({"knowledge": knowledge([0], 1.0), "weights": weights(1.0, (7,))}),
    )


def test_fedhe_needs_no_weights_and_keeps_no_groups() -> None:
    s = strategy("fedhe")
    r = reply({"knowledge": knowledge([0], 1.0)})
    s.validate(Step(1, "train"), agent("a", "mlp_s", {0: 10}, "fedhe"), r)
    s.aggregate(Step(1, "train"), [(A, r)])
    assert s.groups == {}
    assert "weights" not in s.configure(Step(2, "train"), A)


def ctx(seed: int) -> ServerContext:
    return ServerContext.for_step(seed, 1, "cpu")


def velo_after_round(seed: int):
    s = strategy(
        "velo", cvae_z_dim=3, cvae_embed_dim=2, cvae_hidden=8, cvae_epochs=3, same_arch_avg=False
    )
    s.aggregate(
        Step(1, "train"),
        [
            (A, reply({"knowledge": knowledge([0, 1], 1.0)})),
            (B, reply({"knowledge": knowledge([1, 2], -1.0)})),
        ],
    )
    metrics = s.server_train(Step(1, "train"), ctx(seed))
    return s, metrics


def test_velo_trains_after_warm_up_replays_exactly_and_survives_a_restart() -> None:
    a, metrics = velo_after_round(7)
    b, _ = velo_after_round(7)
    c, _ = velo_after_round(8)
    assert metrics["cvae_steps"] == 3 and np.isfinite(metrics["cvae_kl_per_dim"])
    assert metrics["cvae_entries"] == 4.0  # the table's class means
    assert a.synthetic is not None and b.synthetic is not None and c.synthetic is not None
    np.testing.assert_array_equal(a.synthetic.vectors, b.synthetic.vectors)
    assert not np.array_equal(a.synthetic.vectors, c.synthetic.vectors)
    sent = a.configure(Step(2, "train"), A)["knowledge"]
    assert isinstance(sent, FeatureLogitSet)
    np.testing.assert_array_equal(sent.features, a.synthetic.vectors)  # CVAE features...
    np.testing.assert_allclose(sent.logits[1], [0.0] * C)  # ...table logits (mean of 1, -1)
    # a restarted coordinator continues with the same CVAE and samples
    restored = strategy(
        "velo", cvae_z_dim=3, cvae_embed_dim=2, cvae_hidden=8, cvae_epochs=3, same_arch_avg=False
    )
    restored.load_state_dict(a.state_dict())
    assert restored.cvae is not None and a.cvae is not None
    for name, arr in a.cvae.tensors.items():
        np.testing.assert_array_equal(restored.cvae.tensors[name], arr)
    again = restored.configure(Step(2, "train"), A)["knowledge"]
    assert isinstance(again, FeatureLogitSet)
    np.testing.assert_array_equal(again.features, sent.features)


def test_velo_does_not_train_during_warm_up() -> None:
    s = strategy("velo", cvae_z_dim=3, cvae_embed_dim=2, cvae_hidden=8)
    s.plan(60)  # warm-up: 3 rounds; the CVAE first trains after round 3
    assert s.server_train(Step(2, "train"), ctx(0)) == {}


def test_velo_trains_when_the_store_leaves_a_single_sample_batch() -> None:
    # 4 entries in CVAE batches of 3: the trailing batch of one would crash BatchNorm
    s = strategy(
        "velo",
        cvae_z_dim=3,
        cvae_embed_dim=2,
        cvae_hidden=8,
        cvae_epochs=2,
        cvae_batch_size=3,
        same_arch_avg=False,
    )
    s.aggregate(
        Step(1, "train"),
        [
            (A, reply({"knowledge": knowledge([0, 1], 1.0)})),
            (B, reply({"knowledge": knowledge([1, 2], -1.0)})),
        ],
    )
    metrics = s.server_train(Step(1, "train"), ctx(0))
    assert metrics["cvae_steps"] == 2 and s.synthetic is not None


def test_velo_trains_its_cvae_without_the_entries_upload_screen_screens() -> None:
    # Prepare: three agents agree on class 0 (features near 1), a fourth uploads 1e4
    uploads = [(agent(f"a{i}", "mlp_s", {0: 10}), 1.0 + 0.1 * i) for i in range(3)]
    uploads.append((agent("evil", "mlp_s", {0: 10}), 1e4))
    replies = [(a, reply({"knowledge": knowledge([0], v)})) for a, v in uploads]
    sizes = {"cvae_z_dim": 3, "cvae_embed_dim": 2, "cvae_hidden": 8, "cvae_epochs": 1}
    screened = strategy("velo", upload_screen=3.0, same_arch_avg=False, **sizes)
    plain = strategy("velo", same_arch_avg=False, **sizes)
    for s in (screened, plain):
        s.aggregate(Step(1, "train"), replies)
    # Execute
    metrics = screened.server_train(Step(1, "train"), ctx(0))
    plain_metrics = plain.server_train(Step(1, "train"), ctx(0))
    # Assert: one entry left out (batch 50 > 4 entries: one step either way), none without it
    assert metrics["screened_uploads"] == 1.0
    assert "screened_uploads" not in plain_metrics
    assert metrics["cvae_loss"] < plain_metrics["cvae_loss"] / 1000  # the 1e4 entry dominates


def samples(labels: list[int], value: float = 0.0, dim: int = D) -> LabelledVectors:
    rng = np.random.default_rng(len(labels))
    vectors = value + rng.standard_normal((len(labels), dim)).astype(np.float32)
    return LabelledVectors(np.array(labels, np.int32), vectors)


def velo_with_samples(**hyper: object):
    return strategy(
        "velo",
        cvae_z_dim=3,
        cvae_embed_dim=2,
        cvae_hidden=8,
        cvae_epochs=3,
        same_arch_avg=False,
        **hyper,
    )


@pytest.mark.parametrize(
    ("hyper", "payload", "field"),
    [
        ({}, samples([0, 1]), "reply.payloads.samples"),  # not asked for
        ({"upload_samples": 2}, samples([0, 0, 0]), "reply.payloads.samples.labels"),  # 3 > 2
        ({"upload_samples": 2}, samples([2]), "reply.payloads.samples.labels"),  # not A's class
        ({"upload_samples": 2}, samples([0], dim=D + 1), "reply.payloads.samples.vectors"),
    ],
)
def test_a_sample_of_features_is_refused_unless_asked_for_and_fitting(
    hyper: dict, payload: LabelledVectors, field: str
) -> None:
    s = velo_with_samples(**hyper)
    r = reply({"knowledge": knowledge([0, 1], 1.0), "samples": payload})
    with pytest.raises(ValidationError) as err:
        s.validate(Step(1, "train"), A, r)
    assert err.value.field == field


def test_velo_trains_its_cvae_on_the_uploaded_samples_when_it_has_them() -> None:
    # Prepare: class means at +-1, individual features around +-5 (4 a class)
    s = velo_with_samples(upload_samples=4)
    replies = [
        (A, reply({"knowledge": knowledge([0, 1], 1.0), "samples": samples([0] * 4 + [1] * 4, 5)})),
        (B, reply({"knowledge": knowledge([1, 2], -1.0), "samples": samples([1, 2] * 4, -5)})),
    ]
    for a, r in replies:
        s.validate(Step(1, "train"), a, r)
    # Execute
    metrics = s.aggregate(Step(1, "train"), replies)
    trained = s.server_train(Step(1, "train"), ctx(0))
    # Assert: 16 individual entries beside the 4 means; the CVAE trained on the 16, and the
    # state keeps them across a restart
    assert metrics["sample_entries"] == 16.0 and len(s.table) == 4
    assert trained["cvae_entries"] == 16.0
    restored = velo_with_samples(upload_samples=4)
    restored.load_state_dict(s.state_dict())
    np.testing.assert_array_equal(restored.samples.features, s.samples.features)
    np.testing.assert_array_equal(restored.samples.cls, s.samples.cls)


@pytest.mark.parametrize("name", ["felo", "fedhe", "velo"])
def test_a_stale_reply_is_dated_by_its_task_and_weighed_by_its_staleness_weight(
    name: str,
) -> None:
    s = strategy(name, count_weighted=True)
    a = agent("a", "mlp_s", {0: 10, 1: 10}, name)
    b = agent("b", "mlp_s", {1: 10, 2: 10}, name)
    fresh = {"knowledge": knowledge([1], 1.0, [4]), "weights": weights(1.0)}
    stale = {"knowledge": knowledge([1], 5.0, [2]), "weights": weights(5.0)}
    replies = [
        (a, Reply(task_id="ta", round=3, phase="train", num_samples=30, payloads=fresh)),
        (b, Reply(task_id="tb", round=1, phase="train", num_samples=10, payloads=stale)),
    ]
    s.staleness_weights = {"tb": 0.25}  # b answers a task two versions old
    s.aggregate(Step(3, "train"), replies)
    assert s.table.round.tolist() == [3, 1]
    means = s.table.means()
    assert means is not None
    expected = (4 * 1.0 + 0.25 * 2 * 5.0) / (4 + 0.25 * 2)
    np.testing.assert_allclose(means.features[0], [expected] * D, rtol=1e-6)
    if s.config.same_arch_avg:  # the group model: sample count x staleness weight
        group = (30 * 1.0 + 10 * 0.25 * 5.0) / (30 + 10 * 0.25)
        np.testing.assert_allclose(s.groups[group_key(a)].tensors["w"], [group] * 2, rtol=1e-6)
