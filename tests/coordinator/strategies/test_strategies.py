"""Aggregation maths of the strategies, with fake replies (no transport, no torch)."""

import numpy as np
import pytest
from helpers import fake_agent

from coordinator.aggregation import weighted_mean
from coordinator.class_stats import mean_prototypes
from coordinator.strategies import STRATEGIES, AgentInfo, ServerContext, Step, create_strategy
from protocol.algorithms import config_type
from protocol.contract.messages import Reply
from protocol.contract.payloads import PrototypeSet, TensorMap
from protocol.errors import AdmissionError, AggregationError, ValidationError


def agent(device_id: str, classes: dict[int, int], algorithm: str = "fedproto") -> AgentInfo:
    return fake_agent(device_id, algorithm, classes)


def protos(ids: list[int], vecs: list[list[float]], sd: list[float] | None = None) -> PrototypeSet:
    return PrototypeSet(
        np.array(ids),
        np.array(vecs, np.float32),
        np.ones(len(ids), np.int32),
        sd=None if sd is None else np.array(sd, np.float32),
    )


def reply(payloads: dict, n: int = 10, metrics: dict | None = None, phase: str = "train") -> Reply:
    return Reply(
        task_id="t", round=1, phase=phase, num_samples=n, payloads=payloads, metrics=metrics or {}
    )


def test_mean_prototypes_per_class_over_holders_only() -> None:
    # Prepare: class 0 held by both, class 1 by a only, class 2 by nobody (kept from before)
    before = protos([2], [[9.0, 9.0]])
    a = protos([0, 1], [[1.0, 1.0], [4.0, 0.0]])
    b = protos([0], [[3.0, 5.0]])
    # Execute
    out = mean_prototypes(before, [a, b], num_classes=4)
    # Assert
    assert out is not None
    table = out.as_dict()
    assert sorted(table) == [0, 1, 2]  # class 3: held by none, never set
    np.testing.assert_allclose(table[0], [2.0, 3.0])  # unweighted mean of holders
    np.testing.assert_allclose(table[1], [4.0, 0.0])
    np.testing.assert_allclose(table[2], [9.0, 9.0])


@pytest.mark.parametrize("seed", range(5))
def test_mean_prototypes_sums_each_class_in_reply_order_to_the_bit(seed: int) -> None:
    # the sums are float64 additions, set after set: a faster sum must not change one bit
    rng = np.random.default_rng(seed)
    # cancellation: in reply order (1e30 + 1) - 1e30 = 0; summed in another order, 1
    sets = [protos([0], [[v] * 7]) for v in (1e30, 1.0, -1e30)]
    for _ in range(200):
        ids = np.sort(rng.choice(10, rng.integers(0, 6), replace=False))
        scale = 10.0 ** rng.uniform(-4, 4, (ids.size, 1))  # wide magnitudes: order matters
        vecs = (rng.normal(size=(ids.size, 7)) * scale).astype(np.float32)
        sets.append(PrototypeSet(ids, vecs, rng.integers(1, 1000, ids.size)))
    sums, hits, counts = np.zeros((10, 7)), np.zeros(10, np.int64), np.zeros(10, np.int64)
    for p in sets:
        sums[p.class_ids] += p.vectors
        hits[p.class_ids] += 1
        counts[p.class_ids] += p.counts
    out = mean_prototypes(None, sets, num_classes=10)
    assert out is not None
    held = hits > 0
    np.testing.assert_array_equal(out.class_ids, np.nonzero(held)[0])
    expected = (sums[held] / hits[held, None]).astype(np.float32)
    assert out.vectors.tobytes() == expected.tobytes()
    np.testing.assert_array_equal(out.counts, counts[held])


def test_mean_prototypes_rejects_mixed_dimensions() -> None:
    with pytest.raises(AggregationError, match="dimensions differ"):
        mean_prototypes(None, [protos([0], [[1.0]]), protos([1], [[1.0, 2.0]])], num_classes=4)


def test_fedproto_validates_classes_and_dimension() -> None:
    s = create_strategy("fedproto", config_type("fedproto")(), num_classes=4)
    a = agent("a", {0: 5, 1: 5})
    step = Step(1, "train")
    with pytest.raises(ValidationError, match="classes the agent registered"):
        s.validate(step, a, reply({"protos": protos([3], [[1.0, 1.0]])}))
    with pytest.raises(ValidationError, match="prototype set"):
        s.validate(step, a, reply({}))
    s.aggregate(step, [(a, reply({"protos": protos([0], [[1.0, 1.0]])}))])
    with pytest.raises(ValidationError, match="dimension 2"):
        s.validate(step, a, reply({"protos": protos([0], [[1.0, 1.0, 1.0]])}))


def test_mean_prototypes_by_count_is_the_pooled_mean() -> None:
    a = PrototypeSet(np.array([0, 1]), np.array([[1.0], [4.0]], np.float32), np.array([3, 1]))
    b = PrototypeSet(np.array([0]), np.array([[5.0]], np.float32), np.array([1]))
    out = mean_prototypes(None, [a, b], num_classes=2, by_count=True)
    assert out is not None
    np.testing.assert_allclose(out.vectors[:, 0], [(3 * 1.0 + 5.0) / 4, 4.0])
    uniform = mean_prototypes(None, [a, b], num_classes=2)
    assert uniform is not None
    np.testing.assert_allclose(uniform.vectors[:, 0], [3.0, 4.0])
    # staleness weights multiply the counts
    stale = mean_prototypes(None, [a, b], num_classes=2, weights=[1.0, 3.0], by_count=True)
    assert stale is not None
    np.testing.assert_allclose(stale.vectors[0, 0], (3 * 1.0 + 3 * 5.0) / 6)


@pytest.mark.parametrize("count, ok", [(0, False), (1, True), (10, True), (11, False)])
def test_fedproto_by_count_bounds_each_count_by_registered_samples(count: int, ok: bool) -> None:
    # weighted by count, a claim of more samples than registered would take a class's weight
    cfg = config_type("fedproto")(proto_weighting="count", local_epochs=1)
    s = create_strategy("fedproto", cfg, num_classes=4)
    a = agent("a", {0: 4, 1: 6})  # 10 samples registered
    upload = PrototypeSet(np.array([0]), np.ones((1, 2), np.float32), np.array([count]))
    r = reply({"protos": upload})
    if ok:
        s.validate(Step(1, "train"), a, r)
    else:
        with pytest.raises(ValidationError, match=r"protos\.counts"):
            s.validate(Step(1, "train"), a, r)
    # uniform weighting reads no count: the same reply is not refused for it
    create_strategy("fedproto", config_type("fedproto")(), num_classes=4).validate(
        Step(1, "train"), a, r
    )


def test_fedavg_weighted_by_samples() -> None:
    s = create_strategy("fedavg", config_type("fedavg")(), num_classes=4)
    a, b = agent("a", {0: 1}, "fedavg"), agent("b", {1: 1}, "fedavg")
    ra = reply({"weights": TensorMap({"w": np.zeros(2), "n": np.array(3)})}, n=30)
    rb = reply({"weights": TensorMap({"w": np.ones(2) * 4, "n": np.array(5)})}, n=10)
    s.aggregate(Step(1, "train"), [(a, ra), (b, rb)])
    w = s.state_dict()["weights"]
    assert isinstance(w, TensorMap)
    np.testing.assert_allclose(w.tensors["w"], [1.0, 1.0])
    assert int(w.tensors["n"]) == 5  # integer buffers (counters) take the maximum, never a mean


def test_fedvtc_sigma_mean_and_subset_sent_down() -> None:
    s = create_strategy("fedvtc", config_type("fedvtc")(), num_classes=4)
    a, b = agent("a", {0: 5, 1: 5}, "fedvtc"), agent("b", {1: 5, 2: 5}, "fedvtc")
    step = Step(1, "train")
    ra = reply({"protos": protos([0, 1], [[0.0, 0.0], [2.0, 2.0]], sd=[1.0, 3.0])})
    rb = reply({"protos": protos([1, 2], [[4.0, 4.0], [6.0, 6.0]], sd=[3.0, 1.0])})
    s.validate(step, a, ra)
    s.aggregate(step, [(a, ra), (b, rb)])
    sent = s.configure(Step(2, "train"), a)["protos"]
    assert isinstance(sent, PrototypeSet)
    assert sent.class_ids.tolist() == [0, 1]  # only the classes a holds
    np.testing.assert_allclose(sent.as_dict()[1], [3.0, 3.0])
    assert sent.sd is not None
    np.testing.assert_allclose(sent.sd, [2.0, 2.0])  # plain mean over all participants
    with pytest.raises(ValidationError, match="SD vector"):
        s.validate(step, a, reply({"protos": protos([0], [[1.0, 1.0]])}))


def test_generator_averaging_includes_bn_buffers_and_skips_untrained() -> None:
    s = create_strategy("fedvtc", config_type("fedvtc")(), num_classes=4)
    a, b, c = (agent(x, {0: 1}, "fedvtc") for x in "abc")

    def gen(v: float, n: int) -> TensorMap:
        return TensorMap(
            {
                "bn.running_mean": np.full(3, v),
                "conv.weight": np.full((2, 2), v),
                "bn.num_batches_tracked": np.array(n),
            }
        )

    replies = [
        (a, reply({"generator": gen(1.0, 5)}, metrics={"generator_trained": 1.0})),
        (b, reply({"generator": gen(3.0, 9)}, metrics={"generator_trained": 1.0})),
        (c, reply({"generator": gen(100.0, 0)}, metrics={"generator_trained": 0.0})),
    ]
    out = s.aggregate(Step(3, "upload_generator", "all"), replies)
    assert out["generators_averaged"] == 2
    g = s.configure(Step(3, "final", "all"), a)["generator"]
    assert isinstance(g, TensorMap)
    np.testing.assert_allclose(g.tensors["bn.running_mean"], 2.0)
    assert int(g.tensors["bn.num_batches_tracked"]) == 9
    with pytest.raises(AggregationError, match="different tensor names"):
        weighted_mean([gen(1.0, 1), TensorMap({"x": np.zeros(1)})])


def test_every_strategy_has_an_edge_half_with_the_same_name() -> None:
    from edge_agent.algorithms import EDGE_ALGORITHMS

    assert sorted(STRATEGIES) == sorted(EDGE_ALGORITHMS)


def test_fedvtc_per_class_mean_over_holders_keeps_unheld_and_never_invents() -> None:
    # Prepare: 4 classes; round 1: a holds {0, 1}, b holds {1}; round 2 only b participates
    s = create_strategy("fedvtc", config_type("fedvtc")(), num_classes=4)
    a, b = agent("a", {0: 5, 1: 5}, "fedvtc"), agent("b", {1: 5, 2: 5}, "fedvtc")
    r1a = reply({"protos": protos([0, 1], [[2.0, 0.0], [1.0, 1.0]], sd=[1.0, 1.0])})
    r1b = reply({"protos": protos([1], [[3.0, 5.0]], sd=[0.5, 3.0])})
    # Execute
    s.aggregate(Step(1, "train"), [(a, r1a), (b, r1b)])
    r2b = reply({"protos": protos([1, 2], [[7.0, 7.0], [4.0, 4.0]], sd=[2.0, 2.0])})
    out = s.aggregate(Step(2, "train"), [(b, r2b)])
    # Assert
    final = s.configure(Step(3, "final", "all"), a)["protos"]
    assert isinstance(final, PrototypeSet) and final.sd is not None
    table = final.as_dict()
    assert sorted(table) == [0, 1, 2]  # class 3: held by nobody, never sent
    np.testing.assert_allclose(table[0], [2.0, 0.0])  # held by no round-2 participant: kept
    np.testing.assert_allclose(table[1], [7.0, 7.0])  # round 2: b alone, not diluted
    np.testing.assert_allclose(table[2], [4.0, 4.0])  # first seen in round 2
    np.testing.assert_allclose(final.sd, [2.0, 2.0])  # SD mean over round-2 participants
    assert out["classes_with_prototype"] == 3.0
    # round 1's class-1 prototype was the unweighted mean of a's and b's, whatever the counts
    s2 = create_strategy("fedvtc", config_type("fedvtc")(), num_classes=4)
    heavy = reply(
        {
            "protos": PrototypeSet(
                np.array([1]),
                np.array([[3.0, 5.0]], np.float32),
                np.array([1000], np.int32),
                sd=np.ones(2, np.float32),
            )
        }
    )
    s2.aggregate(Step(1, "train"), [(a, r1a), (b, heavy)])
    sent = s2.configure(Step(2, "train"), b)["protos"]
    assert isinstance(sent, PrototypeSet)
    assert sent.class_ids.tolist() == [1]  # b never receives class 0, which it lacks
    np.testing.assert_allclose(sent.as_dict()[1], [2.0, 3.0])


def test_server_context_seed_depends_only_on_run_seed_and_step() -> None:
    # Prepare
    torch = pytest.importorskip("torch")
    a, again = ServerContext.for_step(7, 3), ServerContext.for_step(7, 3, "cpu")
    # Execute
    draws = [torch.rand(4, generator=c.torch_generator()) for c in (a, again)]
    # Assert: a replayed step draws the same numbers; another step or run seed does not
    assert a.seed == again.seed and a.step_index == 3
    assert torch.equal(draws[0], draws[1])
    assert len({a.seed, ServerContext.for_step(7, 4).seed, ServerContext.for_step(8, 3).seed}) == 3
    assert again.device == "cpu"
    assert ServerContext.for_step(7, 3, "auto").device in ("cpu", "cuda")


def test_every_hook_is_dispatched_by_phase_through_one_table() -> None:
    # Prepare
    fedproto = create_strategy("fedproto", config_type("fedproto")(), num_classes=4)
    fedvtc = create_strategy("fedvtc", config_type("fedvtc")(), num_classes=4)
    # Execute
    tables = {name: s.phase_hooks() for name, s in (("fedproto", fedproto), ("fedvtc", fedvtc))}
    folds = {name: sorted(p for p, h in t.items() if h.aggregate) for name, t in tables.items()}
    # Assert: every phase of the plan either has a handler or aggregates nothing
    assert folds == {"fedproto": ["train"], "fedvtc": ["train", "upload_generator"]}
    assert [s.phase for s in fedvtc.plan(1)] == ["train", "upload_generator", "final"]
    # a phase absent from the table does nothing: no payloads, no checks, nothing folded
    step = Step(2, "unplanned")
    a = agent("a", {0: 5}, "fedvtc")
    assert fedvtc.configure(step, a) == {}
    fedvtc.validate(step, a, reply({}))
    assert fedvtc.aggregate(step, [(a, reply({}))]) == {}


def test_fedvtc_every_round_requires_the_generator_the_schema_leaves_optional() -> None:
    s = create_strategy(
        "fedvtc", config_type("fedvtc")(generator_exchange="every_round"), num_classes=4
    )
    a = agent("a", {0: 5}, "fedvtc")
    with pytest.raises(ValidationError, match=r"reply\.payloads\.generator: expected a tensors"):
        s.validate(Step(1, "train"), a, reply({"protos": protos([0], [[1.0, 1.0]], sd=[1.0, 1.0])}))


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_one_architecture_says_whether_admit_refuses_a_second_architecture(name: str) -> None:
    # Planning tools (benchmarks/compare.py) leave mixed fleets out by this flag alone, so it
    # must agree with admission: same input, different architecture and size
    strategy = create_strategy(name, config_type(name)(), num_classes=4)
    first = fake_agent("a", name, {0: 5}, arch="cnn_t1", num_params=10)
    second = fake_agent("b", name, {1: 5}, arch="mlp_s", num_params=20)
    strategy.admit(first, [first])
    try:
        strategy.admit(second, [first, second])
    except AdmissionError:
        refused = True
    else:
        refused = False
    assert refused == STRATEGIES[name].one_architecture
