"""Adaptive deadlines: the rule against hand-computed values, and a simulated fleet with one
device far slower than the rest, which the deadline stops waiting for and reports."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.config import load_config
from coordinator.engine.deadlines import MIN_OBSERVATIONS, DeadlineRule, quantile
from coordinator.sim.clock import SimulatedClock
from coordinator.sim.profile import DeviceProfile, FleetProfile, ProfileGroup
from coordinator.sim.simulate import FleetSpec, simulate
from protocol.errors import ConfigError


def test_quantile_interpolates_between_order_statistics() -> None:
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == pytest.approx(2.5)
    assert quantile([1.0, 2.0, 3.0], 0.9) == pytest.approx(2.8)
    assert quantile([7.0], 0.9) == 7.0


def test_a_fixed_rule_always_gives_the_cap() -> None:
    rule = DeadlineRule(cap_s=120.0)
    rule.observe({"a": 1.0, "b": 2.0}, [])
    assert rule.next().seconds == 120.0


def test_the_adaptive_rule_waits_for_observations_then_scales_a_quantile_within_bounds() -> None:
    rule = DeadlineRule(cap_s=100.0, adaptive=True, quantile=0.5, margin=2.0, floor_s=3.0)
    rule.observe({f"d{i}": 10.0 for i in range(MIN_OBSERVATIONS - 1)}, [])
    assert rule.next().seconds == 100.0 and "needed" in rule.next().reason
    rule.observe({"x": 20.0}, [])  # 4 x 10 s and 20 s: the median is 10 s
    due = rule.next()
    assert due.seconds == pytest.approx(20.0) and "x 2" in due.reason
    fast = DeadlineRule(cap_s=100.0, adaptive=True, quantile=0.5, margin=2.0, floor_s=3.0)
    fast.observe({f"d{i}": 0.1 for i in range(10)}, [])
    assert fast.next().seconds == 3.0 and "floor" in fast.next().reason
    slow = DeadlineRule(cap_s=30.0, adaptive=True, quantile=0.5, margin=2.0, floor_s=3.0)
    slow.observe({f"d{i}": 50.0 for i in range(10)}, [])
    assert slow.next().seconds == 30.0 and "cap" in slow.next().reason


def test_a_device_is_reported_after_three_misses_in_a_row_and_forgiven_by_a_reply() -> None:
    rule = DeadlineRule(cap_s=10.0, adaptive=True)
    assert rule.observe({"a": 1.0}, ["s"]) == []
    assert rule.observe({"a": 1.0}, ["s"]) == []
    assert rule.observe({"a": 1.0}, ["s", "t"]) == ["s"]
    assert rule.observe({"s": 1.0}, ["t"]) == []  # s replied: its count starts again
    assert rule.misses == {"t": 2}


def test_deadline_settings_out_of_range_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="deadline_mode fixed or adaptive"):
        load_config(None, ["run.deadline_mode=soon"], run_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="deadline_min_s"):
        load_config(
            None, ["run.deadline_mode=adaptive", "run.deadline_min_s=200"], run_dir=str(tmp_path)
        )
    # a fixed deadline shorter than the adaptive floor is fine: the floor does not apply
    assert load_config(None, ["run.deadline_s=1"], run_dir=str(tmp_path)).deadline_s == 1.0


def test_an_adaptive_deadline_stops_waiting_for_a_straggler_and_reports_it(
    tmp_path: Path,
) -> None:
    # Prepare: four devices, one 10x slower than the others; the deadline is twice the
    # median reply time once five are known (never below 0.2 s nor above 120 s)
    cfg = load_config(
        None,
        [
            "hyper.local_epochs=1",
            "run.deadline_mode=adaptive",
            "run.deadline_quantile=0.5",
            "run.deadline_margin=2",
            "run.deadline_min_s=0.2",
            "run.grace_s=0",  # no extra wait after a deadline
        ],
        algorithm="fedproto",
        rounds=9,
        run_dir=str(tmp_path / "run"),
        min_agents=4,
        deadline_s=120.0,
        max_retries=0,
        run_id="test-deadlines",
    )
    slow = DeviceProfile(speed=10.0)
    fleet = FleetSpec(
        num_agents=4,
        models=("mlp_s",),
        global_test_size=60,
        profile=FleetProfile((ProfileGroup(0.25, slow),)),
    )
    (straggler,) = [
        f"agent{i}" for i, p in enumerate(fleet.profile.assign(4, cfg.seed)) if p == slow
    ]  # type: ignore[union-attr]
    # Execute: on a simulated clock on which every task takes 0.1 s of host time, so that the
    # machine's load cannot make the fast devices miss the tight deadline too
    result = simulate(cfg, fleet, clock=SimulatedClock(compute_s=0.1))
    # Assert: the first rounds wait for it under the cap; once the rule has its five reply
    # times the deadline shrinks, the straggler misses, and after three misses in a row it is
    # reported (and the run never stopped for it)
    steps = result.metrics
    assert [m["phase"] for m in steps] == ["train"] * 9 + ["final"]
    assert steps[0]["deadline_s"] == 120.0 and straggler in steps[0]["agents"]
    late = steps[-1]
    assert late["deadline_s"] < 120.0 and straggler not in late["agents"]
    assert any(straggler in m["stragglers"] for m in steps)
    assert all(set(m["stragglers"]) <= {straggler} for m in steps)
