"""A run whose algorithm reads the label histogram, under ``hyper.dp``: the coordinator
announces the budget, every device registers its histogram noised (once, charged to its
budget), and the replies, bounded by the noised counts, are all accepted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import failed_tasks

from coordinator.sim.simulate import agent_options, simulate
from coordinator.store.database import Store
from edge_agent.dp import noise_multiplier
from protocol.contract.codec import decode
from protocol.contract.messages import Register
from tests.helpers_runtime import FLEET, run_config

EPSILON, ROUNDS = 4.0, 2


@pytest.mark.parametrize(("algorithm", "per_release"), [("fd", 2), ("felo", 3)])
def test_every_device_registers_its_histogram_noised_and_every_reply_is_accepted(
    tmp_path: Path, algorithm: str, per_release: int
) -> None:
    # Prepare
    cfg = run_config(tmp_path, algorithm, rounds=ROUNDS, run_id=f"counts-{algorithm}")
    hyper = {"dp_epsilon": EPSILON, **({"same_arch_avg": False} if algorithm == "felo" else {})}
    cfg = cfg.replace(hyper={**cfg.hyper, **hyper})
    # Execute
    result = simulate(cfg, FLEET)
    # Assert: no task failed; the coordinator holds each device's noised histogram, which the
    # device's ledger charged as the first mechanism of the run's one z; within the budget
    assert failed_tasks(tmp_path / "run") == []
    assert agent_options(cfg, FLEET, 0).class_counts is None  # none registers before the state
    store = Store(tmp_path / "run" / "state.sqlite")
    registers = {d: decode(raw).body for d, raw in store.agents()}
    z = noise_multiplier(EPSILON, 1e-5, ROUNDS, per_release, 1)
    for device, register in registers.items():
        ledger = json.loads((tmp_path / "run" / "agents" / device / "privacy.json").read_text())
        assert isinstance(register, Register)
        held = {str(c): n for c, n in enumerate(ledger["registered"]) if n > 0}
        assert register.class_counts == held
        assert ledger["events"][0] == [z, 1, 1.0]
    last = [m for m in result.metrics if m["phase"] == "train"][-1]
    assert sorted(last["agents"]) == sorted(registers)
    assert all(0 < a["dp_epsilon"] <= EPSILON * (1 + 1e-6) for a in last["agents"].values())
