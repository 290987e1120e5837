"""Felo with ``same_arch_avg`` under ``hyper.dp``, end to end: the coordinator announces the
sums' part of the budget, every device registers its histogram noised at the sums' multiplier,
trains by DP-SGD and releases its sums on one budget, and reports the epsilon spent; a device
whose budget is spent stops contributing with the ledger's message (on one device:
tests/edge_agent/test_felo_dp_edge.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import failed_tasks

from coordinator.sim.simulate import simulate
from edge_agent.dp import noise_multiplier
from tests.helpers_runtime import FLEET, run_config

EPSILON, SHARE = 4.0, 0.5


def test_a_felo_run_averages_dp_sgd_weights_and_noised_sums_on_one_budget(
    tmp_path: Path,
) -> None:
    # Prepare: the budget spread over the run's two rounds
    rounds = releases = 2
    cfg = run_config(tmp_path, "felo", rounds=rounds, run_id="felo-dp")
    hyper = {"dp_epsilon": EPSILON, "dp_releases": releases, "same_arch_avg": True}
    cfg = cfg.replace(hyper={**cfg.hyper, **hyper})
    # Execute
    result = simulate(cfg, FLEET)
    # Assert: every device's ledger starts with its registration at the sums' multiplier
    # (half the budget, `releases` releases of 3 sums and the registration) and spends at most
    # the budget; its first reply reports it
    devices = sorted(f"agent{i}" for i in range(FLEET.num_agents))
    z = noise_multiplier(EPSILON * SHARE, 1e-5, releases, 3, 1)
    for device in devices:
        ledger = json.loads((tmp_path / "run" / "agents" / device / "privacy.json").read_text())
        assert ledger["events"][0] == [z, 1, 1.0]
        assert [e[1:] for e in ledger["events"][1:]].count([3, 1.0]) == releases
        assert len([e for e in ledger["events"] if e[2] < 1]) == releases  # DP-SGD's rounds
    train = [m for m in result.metrics if m["phase"] == "train"]
    first = train[0]["agents"]
    assert sorted(first) == devices
    assert all(0 < a["dp_epsilon"] <= EPSILON * (1 + 1e-6) for a in first.values())
    assert failed_tasks(tmp_path / "run") == []
    last = train[-1]["agents"]
    assert all(a["dp_epsilon"] == pytest.approx(EPSILON, rel=1e-3) for a in last.values())
