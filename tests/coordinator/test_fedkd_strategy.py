"""FedKD server half with fake replies (the mentee averaged by sample count, one input spec)
and one short run over the in-memory transport."""

from pathlib import Path

import numpy as np
import pytest

import coordinator.strategies.fedkd  # noqa: F401  (registers the server half)
import edge_agent.algorithms.fedkd  # noqa: F401  (registers the edge half)
from coordinator.config import load_config
from coordinator.simulate import FleetSpec, simulate
from coordinator.strategies import AgentInfo, Step, create_strategy
from protocol.algorithms.fedkd import FedKDConfig
from protocol.errors import AdmissionError
from protocol.messages import Capabilities, InputSpec, Register, Reply
from protocol.payloads import TensorMap


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


def test_fedkd_runs_end_to_end(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        ["hyper.batch_size=32"],
        algorithm="fedkd",
        rounds=2,
        run_dir=str(tmp_path / "fedkd"),
        min_agents=3,
        deadline_s=120.0,
        run_id="test-fedkd",
    )
    fleet = FleetSpec(3, ("cnn_t1", "mlp_s", "cnn_t2"), "digits", "dirichlet:0.5", 32, None, 200)
    result = simulate(cfg, fleet)
    assert [m["phase"] for m in result.metrics] == ["train", "train", "final"]
    for m in result.metrics:
        accs = [a["acc_global"] for a in m["agents"].values()]
        assert len(accs) == 3 and all(np.isfinite(accs))
    assert result.metrics[0]["aggregate"]["aggregated"] == 3
    for a in result.metrics[1]["agents"].values():
        assert np.isfinite(a["train_loss"]) and 0.0 <= a["shared_acc"] <= 1.0
