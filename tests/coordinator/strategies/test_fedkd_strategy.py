"""FedKD server half with fake replies (the mentee averaged by sample count, one input spec);
whole runs: test_every_algorithm.py."""

import numpy as np
import pytest

import coordinator.strategies.fedkd  # noqa: F401  (registers the server half)
import edge_agent.algorithms.fedkd  # noqa: F401  (registers the edge half)
from coordinator.strategies import AgentInfo, Step, create_strategy
from protocol.algorithms.fedkd import FedKDConfig
from protocol.contract.lowrank import compress, restore
from protocol.contract.messages import Capabilities, InputSpec, Register, Reply
from protocol.contract.payloads import TensorMap
from protocol.errors import AdmissionError, ValidationError


def agent(device_id: str, arch: str, size: int = 8) -> AgentInfo:
    reg = Register(
        device_id=device_id,
        arch=arch,
        num_params=10,
        capabilities=Capabilities(device="cpu"),
        input_spec=InputSpec(3, size, size),
        num_classes=3,
        class_counts={"0": 5},
        algorithm="fedkd",
    )
    return AgentInfo(device_id, reg)


def reply(value: float, n: int) -> Reply:
    w = TensorMap({"w": np.full(3, value, np.float32)})
    return Reply(task_id="t", round=1, phase="train", num_samples=n, payloads={"weights": w})


def test_mentees_average_by_sample_count_and_one_input_is_required() -> None:
    s = create_strategy("fedkd", FedKDConfig(), num_classes=3)
    a, b = agent("a", "mlp_s"), agent("b", "cnn_t1")
    s.admit(b, [a])
    with pytest.raises(AdmissionError, match="mlp_s"):
        s.admit(agent("c", "mlp_s", size=16), [a])
    s.aggregate(Step(1, "train"), [(a, reply(0.0, 30)), (b, reply(2.0, 10))])
    sent = s.configure(Step(2, "train"), a)["weights"]
    assert isinstance(sent, TensorMap)
    np.testing.assert_allclose(sent.tensors["w"], [0.5] * 3)  # 20 / 40


def mentee_reply(w: np.ndarray, n: int, energy: float = 0.999) -> Reply:
    weights = compress(
        TensorMap({"fc.weight": w, "fc.bias": np.zeros(w.shape[0], np.float32)}), energy
    )
    return Reply(task_id="t", round=1, phase="train", num_samples=n, payloads={"weights": weights})


def test_compressed_mentees_are_checked_restored_averaged_and_sent_compressed() -> None:
    # Prepare: two rank-2 40x30 mentees, uploaded as factors; the ramp spans the run's 4 rounds
    rng = np.random.default_rng(0)
    basis_l, basis_r = rng.normal(size=(40, 2)), rng.normal(size=(2, 30))
    w1 = (basis_l @ basis_r).astype(np.float32)
    w2 = (basis_l @ (2 * basis_r)).astype(np.float32)
    s = create_strategy("fedkd", FedKDConfig(), num_classes=3)
    s.plan(4)
    assert s.config.svd_rounds == 4 and s.config.svd_energy(1) == pytest.approx(0.95)
    a, b = agent("a", "mlp_s"), agent("b", "cnn_t1")
    r1, r2 = mentee_reply(w1, 30), mentee_reply(w2, 10)
    assert "fc.weight#u" in r1.payloads["weights"].tensors  # type: ignore[union-attr]
    # Execute
    for ag, r in ((a, r1), (b, r2)):
        s.validate(Step(1, "train"), ag, r)
    s.aggregate(Step(1, "train"), [(a, r1), (b, r2)])
    sent = s.configure(Step(2, "train"), a)["weights"]
    # Assert: the global mentee is the weighted mean of the whole tensors; it goes out as factors
    assert isinstance(sent, TensorMap) and "fc.weight#s" in sent.tensors
    assert sent.tensors["fc.weight#s"].size == 2
    np.testing.assert_allclose(
        restore(sent).tensors["fc.weight"], 0.75 * w1 + 0.25 * w2, rtol=1e-3, atol=1e-3
    )
    assert s.configure(Step(2, "train"), b)["weights"] is sent  # compressed once per round


def test_a_mentee_with_inconsistent_factors_is_refused_before_aggregation() -> None:
    s = create_strategy("fedkd", FedKDConfig(), num_classes=3)
    good = mentee_reply(np.ones((40, 30), np.float32), 10)
    bad_tensors = dict(good.payloads["weights"].tensors)  # type: ignore[union-attr]
    bad_tensors["fc.weight#shape"] = np.array([40, 31])
    bad = Reply(
        task_id="t",
        round=1,
        phase="train",
        num_samples=10,
        payloads={"weights": TensorMap(bad_tensors)},
    )
    with pytest.raises(ValidationError, match=r"fc\.weight#v"):
        s.validate(Step(1, "train"), agent("a", "mlp_s"), bad)
