"""benchmarks/async_fleet.py's planning and reading: the fleet it profiles, the runs it plans,
the curve it reads from step records."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # its own imports

import async_fleet


def test_a_share_of_the_fleet_is_slow_and_every_device_drops_replies() -> None:
    args = async_fleet.parse_args(
        ["--slow-share", "0.2", "--slow-factor", "10", "--dropout", "0.1"]
    )
    profiles = async_fleet._fleet_profile(async_fleet.profile_doc(args)).assign(10, 0)
    assert sorted(p.speed for p in profiles) == [1.0] * 8 + [10.0] * 2
    assert {p.dropout for p in profiles} == {0.1}


def test_buffered_runs_about_as_many_replies_as_the_synchronous_rounds() -> None:
    args = async_fleet.parse_args(["--agents", "10", "--rounds", "3", "--buffer-size", "4"])
    plan = {(s["algorithm"], s["mode"]): s for s in async_fleet.specs(args)}
    assert set(plan) == {
        (a, m) for a in ("fedavg", "fedproto", "felo") for m in ("sync", "buffered")
    }
    assert plan["felo", "sync"]["rounds"] == 3 and plan["felo", "sync"]["buffer_size"] == 0
    assert plan["felo", "buffered"]["rounds"] == 8  # ceil(3 x 10 / 4)
    assert plan["fedavg", "buffered"]["family"] == "homo_mlp"
    assert plan["fedproto", "buffered"]["family"] == "tiny"


def step(round_: int, time: float, duration: float, acc: float, staleness: dict) -> dict:
    return {
        "phase": "train",
        "round": round_,
        "time": time,
        "duration_s": duration,
        "mean_acc_global": acc,
        "mean_acc_local": acc + 0.1,
        "bytes_total": 100 * round_,
        "agents": {d: {} for d in staleness},
        "staleness": staleness,
    }


def test_the_curve_counts_time_from_the_first_dispatch_and_stale_replies() -> None:
    steps = [
        step(1, 110.0, 10.0, 0.2, {"a": 0, "b": 0}),
        step(2, 115.0, 5.0, 0.4, {"a": 0, "c": 1}),
        {
            "phase": "final",
            "round": 3,
            "time": 130.0,
            "mean_acc_global": 0.5,
            "mean_acc_local": 0.7,
        },
    ]
    out = async_fleet.summarise(steps)
    assert [p["t_s"] for p in out["curve"]] == [10.0, 15.0]
    assert [p["stale_replies"] for p in out["curve"]] == [0, 1]
    assert out["final"] == {"acc_global": 0.5, "acc_local": 0.7}
    assert async_fleet.acc_at(out["curve"], 12.0) == 0.2
    assert async_fleet.acc_at(out["curve"], 9.0) is None


def _run(
    mode: str,
    seed: int,
    curve: list[tuple[float, float]],
    final: float,
    clock: dict[str, Any] | None = None,
) -> dict[str, Any]:
    points = [{"t_s": t, "acc_global": a, "bytes": 100} for t, a in curve]
    return {
        "spec": {"algorithm": "fedavg", "mode": mode, "seed": seed, **(clock or {})},
        "curve": points,
        "final": {"acc_global": final},
    }


def test_summary_times_the_buffered_run_to_the_synchronous_runs_final_accuracy() -> None:
    runs = [
        _run("sync", 1, [(50.0, 0.3), (100.0, 0.5)], 0.5),
        _run("buffered", 1, [(5.0, 0.4), (10.0, 0.5), (20.0, 0.6)], 0.6),  # reaches 0.5 at 10 s
        _run("sync", 2, [(200.0, 0.4)], 0.4),
        _run("buffered", 2, [(30.0, 0.3), (40.0, 0.35)], 0.32),  # never reaches 0.4
    ]
    assert async_fleet.reach(runs[1]["curve"], 0.5) == 1
    assert async_fleet.reach(runs[3]["curve"], 0.4) is None
    text = async_fleet.summary(runs)
    assert text.startswith("Times: wall-clock seconds")  # no clock in the specs: the real one
    row = text.splitlines()[4].split("|")
    assert row[2].strip() == "2" and row[3].strip() == "150.0"  # mean sync training time
    assert row[4].strip() == "10.0 (10 %)"  # 10 s of sync's 100 s, the seed that reached it
    assert row[5].strip() == "1 of 2"
    assert row[6].strip() == "150"  # sync's bytes: 200 and 100
    assert row[7].strip() == "200 (100 %)"  # two steps of 100 bytes, as many as sync's two
    assert row[8].strip().startswith("+1.0 [")  # +10 and -8 points: mean +1
    assert row[9].strip() == "not met"  # one seed never reached it


def test_the_goal_is_half_the_time_and_at_most_a_point_lower_at_the_end() -> None:
    def verdict(buffered_final: float, reached_at: float) -> str:
        runs = [
            _run("sync", 1, [(50.0, 0.3), (100.0, 0.5)], 0.5),
            _run("buffered", 1, [(reached_at, 0.5), (120.0, 0.5)], buffered_final),
        ]
        return async_fleet.summary(runs).splitlines()[4].split("|")[9].strip()

    assert verdict(0.495, 50.0) == "met"  # half the time, half a point lower
    assert verdict(0.485, 50.0) == "not met"  # 1.5 points lower at the end
    assert verdict(0.6, 51.0) == "not met"  # more than half the time


def test_a_simulated_run_records_its_clock_and_the_table_says_which() -> None:
    simulated = async_fleet.parse_args([])
    assert simulated.clock == "simulated"
    assert simulated.out == Path("benchmarks/results/async_fleet_simclock.json")
    real = async_fleet.parse_args(["--clock", "real"])
    assert real.out == Path("benchmarks/results/async_fleet.json")
    sim_specs, real_specs = async_fleet.specs(simulated), async_fleet.specs(real)
    assert {(s["clock"], s["compute_s"]) for s in sim_specs} == {("simulated", 1.0)}
    assert all("clock" not in s for s in real_specs)  # as the real clock's results file holds
    measured = async_fleet.specs(async_fleet.parse_args(["--compute-s", "0"]))
    assert {s["compute_s"] for s in measured} == {None}
    # same fleet and rounds, another clock: another run, another setting
    pairs = zip(sim_specs, real_specs, strict=True)
    assert all(async_fleet.setting(a) != async_fleet.setting(b) for a, b in pairs)
    clock = {"clock": "simulated", "compute_s": 1.0}
    runs = [_run("sync", 1, [(100.0, 0.5)], 0.5, clock), _run("buffered", 1, [], 0.5, clock)]
    assert async_fleet.summary(runs).startswith(
        "Times: simulated seconds since the first dispatch (the simulated clock: each task "
        "1 s of compute x the device's speed, fixed so that the host's load leaves the timeline "
        "alone)"
    )
