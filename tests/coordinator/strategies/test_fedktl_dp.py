"""FedKTL under ``hyper.dp``, end to end in buffered mode: every device's prototypes go out
noised, its replies report the epsilon spent, the budget holds, and stale replies still fold in."""

from __future__ import annotations

from pathlib import Path

from helpers import failed_tasks

import coordinator.strategies.fedktl.strategy
import edge_agent.algorithms.fedktl  # noqa: F401  (registers both halves)
from coordinator.sim.simulate import FleetSpec, simulate
from tests.helpers_runtime import run_config

_ = coordinator.strategies.fedktl.strategy
ROUNDS, EPSILON = 3, 4.0
FLEET = FleetSpec(
    num_agents=3, models=("cnn_t1", "mlp_s", "cnn_t1"), data="digits", partition="iid",
    feature_dim=10,
)  # fmt: skip


def test_a_buffered_fedktl_run_under_dp_spends_within_each_devices_budget(tmp_path: Path) -> None:
    # Prepare: a global update every 2 replies, so the third device's reply arrives stale
    cfg = run_config(
        tmp_path, "fedktl", rounds=ROUNDS, run_id="ktl-dp", mode="buffered", buffer_size=2
    )
    hyper = {"generator": "cppn", "server_epochs": 5, "batch_size": 32, "dp_epsilon": EPSILON}
    cfg = cfg.replace(hyper={**cfg.hyper, **hyper})
    # Execute
    result = simulate(cfg, FLEET)
    # Assert: no task failed; each device's epsilon grows within the budget; F trained on
    # the noised prototypes every training step
    assert failed_tasks(tmp_path / "run") == []
    train = [m for m in result.metrics if m["phase"] == "train"]
    assert all(m["aggregate"]["ktl_prototypes"] > 0 for m in train)
    assert any(max(m["staleness"].values()) > 0 for m in train)  # a stale reply folded in
    spent: dict[str, list[float]] = {}
    for m in train:
        for device, reply in m["agents"].items():
            spent.setdefault(device, []).append(reply["dp_epsilon"])
    assert sorted(spent) == ["agent0", "agent1", "agent2"]
    for eps in spent.values():
        assert eps == sorted(eps) and 0 < eps[-1] <= EPSILON * (1 + 1e-6)
