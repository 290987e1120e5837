"""FedType server half with fake replies (FedAvg of the proxies through FedAvg's own code,
admission by input spec, layout checks), and a whole run over the in-memory transport with
three private architectures (metrics per round, pooled coverage: Gate B of spec §10)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import fake_agent

import edge_agent.algorithms.fedtype  # registers the edge half before agents are built
from coordinator.config import load_config
from coordinator.sim.simulate import FleetSpec, simulate
from coordinator.strategies import AgentInfo, Step, create_strategy, weight_averaging
from coordinator.strategies.fedtype import FedTypeStrategy
from protocol.algorithms.fedtype import FedTypeConfig
from protocol.contract.messages import Reply
from protocol.contract.payloads import TensorMap
from protocol.errors import AdmissionError, ValidationError

assert edge_agent.algorithms.fedtype
C = 3


def agent(device_id: str, arch: str, size: int = 8) -> AgentInfo:
    params = 10 if arch == "mlp_s" else 99
    return fake_agent(
        device_id,
        "fedtype",
        {0: 5},
        num_classes=C,
        arch=arch,
        num_params=params,
        input_spec=(1, size, size),
    )


def proxy(value: float, shape: tuple[int, ...] = (2,), steps: int = 3) -> TensorMap:
    return TensorMap({"w": np.full(shape, value, np.float32), "n": np.array(steps, np.int64)})


def reply(w: TensorMap, n: int) -> Reply:
    return Reply(task_id="t", round=1, phase="train", num_samples=n, payloads={"weights": w})


def strategy(**hyper: Any) -> FedTypeStrategy:
    cfg = FedTypeConfig.from_dict(dict(hyper))
    s = create_strategy("fedtype", cfg, num_classes=C, seed=0)
    assert isinstance(s, FedTypeStrategy)
    return s


A, B = agent("a", "mlp_s"), agent("b", "cnn_t1")


def test_proxies_are_averaged_by_fedavgs_weighted_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = weight_averaging.weighted_mean

    def spy(maps: Any, weights: Any, *args: Any, **kw: Any) -> TensorMap:
        calls.append(len(maps))
        return real(maps, weights, *args, **kw)

    monkeypatch.setattr(weight_averaging, "weighted_mean", spy)  # FedAvg's own call site
    s = strategy()
    s.aggregate(Step(1, "train"), [(A, reply(proxy(1.0), 30)), (B, reply(proxy(5.0, steps=7), 10))])
    assert calls == [2]
    assert s.weights is not None
    np.testing.assert_allclose(s.weights.tensors["w"], [2.0, 2.0])  # (30 * 1 + 10 * 5) / 40
    assert int(s.weights.tensors["n"]) == 7  # integer buffers: the maximum
    sent = s.configure(Step(2, "train"), B)["weights"]
    assert isinstance(sent, TensorMap)
    np.testing.assert_allclose(sent.tensors["w"], [2.0, 2.0])


def test_uniform_weights_and_f16_transport() -> None:
    s = strategy(aggregation_weights="uniform", weight_encoding="f16")
    s.aggregate(Step(1, "train"), [(A, reply(proxy(1.0), 30)), (B, reply(proxy(5.0), 10))])
    assert s.weights is not None and s.weights.encoding == "f16"
    np.testing.assert_allclose(s.weights.tensors["w"], [3.0, 3.0])


def test_any_private_architecture_is_admitted_but_one_input_spec() -> None:
    s = strategy(proxy_model="mlp_xs")
    s.admit(B, [A])  # different private models: fine
    with pytest.raises(AdmissionError, match=r"mlp_xs.*1x8x8.*1x16x16"):
        s.admit(agent("c", "mlp_s", size=16), [A, B])


def test_round_one_averages_the_common_layout_and_later_ones_match_the_global_proxy() -> None:
    s = strategy()
    step = Step(1, "train")
    c = agent("c", "mlp_s")
    replies = [
        (A, reply(proxy(1.0), 10)),
        (B, reply(proxy(1.0, shape=(3,)), 10)),  # alone in its layout: left out
        (c, reply(proxy(3.0), 10)),
    ]
    for a, r in replies:
        s.validate(step, a, r)  # no single upload fixes the layout
    assert s.aggregate(step, replies)["layout_outliers"] == 1.0
    with pytest.raises(ValidationError, match="global model"):
        s.validate(Step(2, "train"), B, reply(proxy(1.0, shape=(3,)), 10))
    s.validate(Step(2, "train"), B, reply(proxy(2.0), 10))


FLEET = FleetSpec(
    num_agents=3,
    models=("mlp_w", "cnn_fc", "mlp_xl"),  # §10's heterogeneous private pool
    data="digits",
    partition="dirichlet:0.5",
    feature_dim=None,
    global_test_size=200,
)
HYPER = {
    "proxy_model": "mlp_xs",
    "local_epochs": 2,
    "lr": 1e-3,
    "val_fraction": 0.25,
    "raps_k_reg": 2,
}


def run(tmp_path: Path, rounds: int = 3, **hyper: Any) -> Any:
    values = {**HYPER, **hyper}
    cfg = load_config(
        None,
        [f"hyper.{k}={v}" for k, v in values.items()],
        algorithm="fedtype",
        rounds=rounds,
        run_dir=str(tmp_path / "fedtype"),
        min_agents=3,
        deadline_s=120.0,
        run_id="test-fedtype",
    )
    return simulate(cfg, FLEET)


@pytest.mark.slow
def test_a_run_reports_three_accuracies_and_covers_at_one_minus_theta(tmp_path: Path) -> None:
    # Execute
    result = run(tmp_path)
    # Assert: every round, every agent reports the private, proxy and global-proxy accuracy
    steps = result.metrics
    assert [m["phase"] for m in steps] == ["train"] * 3 + ["final"]
    hits = n = 0.0
    for step in steps[:3]:
        assert sorted(step["agents"]) == ["agent0", "agent1", "agent2"]
        for m in step["agents"].values():
            for key in ("acc_local", "proxy_acc", "global_proxy_acc", "mean_eta"):
                assert 0 <= m[key] <= 1, key
            assert m["sets_not_nested"] == 0 and m["mean_set_size"] >= 1
            hits += m["coverage_proxy"] * m["coverage_n"]
            n += m["coverage_n"]
    # Gate B: coverage of the calibrated proxy sets, pooled over clients x epochs x rounds
    cov = hits / n
    assert cov >= 0.9 - 3 * math.sqrt(0.9 * 0.1 / n)
    final = steps[-1]["agents"]
    assert all(0 <= m["global_proxy_acc"] <= 1 for m in final.values())
    # the proxy is the same size for all three private architectures: so are the uploads
    assert steps[0]["bytes"]["rx.reply"] > 0
