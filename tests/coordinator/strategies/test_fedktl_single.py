"""FedKTL's single-client mode (paper App. B, Table 9): one agent and the server run the same
loop; the server aligns F on that agent's prototypes alone and sends it the pairs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import coordinator.strategies.fedktl.strategy
import edge_agent.algorithms.fedktl  # noqa: F401  (registers both halves)
from coordinator.sim.simulate import FleetSpec, simulate
from tests.helpers_runtime import run_config

_ = coordinator.strategies.fedktl.strategy
ROUNDS = 3
ONE = FleetSpec(
    num_agents=1, models=("cnn_t1",), data="digits", partition="dirichlet:1.0", feature_dim=10
)


def test_one_agent_and_the_server_run_the_whole_loop(tmp_path: Path) -> None:
    # Prepare
    cfg = run_config(tmp_path, "fedktl", rounds=ROUNDS, min_agents=1, run_id="ktl-single")
    hyper = {"generator": "cppn", "cppn_w_dim": 16, "server_epochs": 5, "batch_size": 32}
    cfg = cfg.replace(hyper={**cfg.hyper, **hyper})

    # Execute
    result = simulate(cfg, ONE)

    # Assert: F trained every round on the agent's 10 prototypes; pairs from round 2 on
    steps = result.metrics
    assert [(m["round"], m["phase"]) for m in steps][-1] == (ROUNDS + 1, "final")
    for r, step in enumerate(steps[:ROUNDS], start=1):
        agg = step["aggregate"]
        assert agg["ktl_prototypes"] == 10 and agg["ktl_steps"] == 5
        assert agg["ktl_centroid_dist_min"] > 0
        assert step["agents"]["agent0"]["ktl_pairs"] == (0 if r == 1 else 10)
    assert np.isfinite(steps[-1]["agents"]["agent0"]["acc_local"])
