"""benchmarks/async_fleet.py's planning and reading: the fleet it profiles, the runs it plans,
the curve it reads from step records."""

from __future__ import annotations

import sys
from pathlib import Path

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
