"""CCVR under ``hyper.dp``, end to end: the FedAvg rounds train by DP-SGD, every device's
statistics (formed from noised sums, positive semi-definite) pass the coordinator's checks and
calibrate the head, and each device's epsilon reaches its budget with the statistics."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import failed_tasks

from coordinator.sim.simulate import FleetSpec, simulate
from tests.helpers_runtime import run_config

EPSILON = 4.0
FLEET = FleetSpec(num_agents=3, models=("mlp_s",) * 3, data="digits", partition="iid")


def test_a_ccvr_run_under_dp_calibrates_on_noised_statistics_within_each_budget(
    tmp_path: Path,
) -> None:
    # Prepare
    cfg = run_config(tmp_path, "ccvr", rounds=2, run_id="ccvr-dp")
    cfg = cfg.replace(hyper={**cfg.hyper, "dp_epsilon": EPSILON})
    # Execute
    result = simulate(cfg, FLEET)
    # Assert: no task failed; the rounds spend part of the budget, the statistics the rest
    assert failed_tasks(tmp_path / "run") == []
    by_phase = {m["phase"]: m for m in result.metrics}
    train = [m for m in result.metrics if m["phase"] == "train"]
    devices = sorted(f"agent{i}" for i in range(FLEET.num_agents))
    assert sorted(train[-1]["agents"]) == devices
    assert all(0 < a["dp_epsilon"] < EPSILON for a in train[-1]["agents"].values())
    stats = by_phase["upload_stats"]
    assert sorted(stats["agents"]) == devices
    for reply in stats["agents"].values():
        assert reply["dp_epsilon"] == pytest.approx(EPSILON, rel=1e-3)
        assert reply["dp_epsilon"] <= EPSILON * (1 + 1e-6)
    assert stats["aggregate"]["calibration_classes"] > 0
