"""A simulated clock for profiled simulations: replies scheduled, not slept, at their simulated
arrival; deadlines, reply times and the metrics' times read on that clock.

The whole runs go over a real Mosquitto with one device 100x slower than the others and every
task computing a fixed 0.1 s on the host (``compute_s``), so the simulated timeline is exact:
a fast device answers 1 + 0.1 + 1 = 2.1 s after its task went out, the slow one 1 + 10 + 1 = 12 s.
"""

from __future__ import annotations

import itertools
import json
import queue
from pathlib import Path
from typing import Any

import pytest
from helpers import unique_id

from coordinator.broker.embedded import MosquittoBroker
from coordinator.cli import main as cli_main
from coordinator.config import load_config
from coordinator.engine.deadlines import DeadlineRule
from coordinator.sim.clock import SimulatedClock
from coordinator.sim.profile import DeviceProfile, FleetProfile, ProfiledTransport, ProfileGroup
from coordinator.sim.simulate import FleetSpec, simulate
from protocol.contract.topics import Topics
from protocol.errors import ConfigError
from protocol.transport.base import MemoryBroker, MemoryTransport, Transport, Will
from protocol.transport.paho import MqttTransport

SLOW = DeviceProfile(speed=100.0, delay_s=1.0)
PROFILE = FleetProfile(groups=(ProfileGroup(1 / 3, SLOW),), default=DeviceProfile(delay_s=1.0))
FAST_S = 1.0 + 0.1 + 1.0  # downlink, compute, uplink
SLOW_S = 1.0 + 100 * 0.1 + 1.0


def run(tmp_path: Path, port: int, **run: Any) -> tuple[list[dict[str, Any]], str, str]:
    """A 3-device FedProto run under PROFILE on a simulated clock: its training records, the
    slow device and one fast one."""
    cfg = load_config(
        None,
        [],
        algorithm="fedproto",
        run_dir=str(tmp_path / "run"),
        min_agents=3,
        federation=unique_id("simclock"),
        run_id="simclock",
        **run,
    )
    fleet = FleetSpec(
        num_agents=3, models=("mlp_s",), data="digits", feature_dim=8, profile=PROFILE
    )

    def factory(client_id: str, will: Will) -> Transport:
        return MqttTransport(client_id=f"{cfg.federation}-{client_id}", port=port, will=will)

    result = simulate(cfg, fleet, transport_factory=factory, clock=SimulatedClock(compute_s=0.1))
    profiles = PROFILE.assign(3, cfg.seed)
    slow = f"agent{profiles.index(SLOW)}"
    fast = next(f"agent{i}" for i, p in enumerate(profiles) if p != SLOW)
    return [m for m in result.metrics if m["phase"] == "train"], slow, fast


@pytest.mark.network
def test_a_slow_devices_reply_is_folded_as_stale_as_its_simulated_arrival_makes_it(
    tmp_path: Path, mosquitto: MosquittoBroker
) -> None:
    # Execute: buffered, two replies a version; the slow device's first reply arrives 12 s
    # after the first dispatch, in the sixth version (opened at 5 x 2.1 = 10.5 s)
    train, slow, fast = run(
        tmp_path, mosquitto.port, rounds=7, mode="buffered", buffer_size=2, deadline_s=60.0
    )

    # Assert: five versions of the fast devices alone, each 2.1 simulated seconds; then the
    # slow reply, 5 versions stale, in the sixth, which closes at 6 x 2.1 s
    start = train[0]["time"] - FAST_S  # the first dispatch
    for k, record in enumerate(train[:5], start=1):
        assert slow not in record["agents"], (k, record["agents"])
        assert record["staleness"] == {d: 0 for d in record["agents"]}
        assert record["time"] - start == pytest.approx(k * FAST_S, abs=1e-4)
        assert record["reply_s"][fast] == pytest.approx(FAST_S)
    sixth = train[5]
    assert sixth["staleness"][slow] == 5
    assert start + SLOW_S < sixth["time"]
    assert sixth["time"] - start == pytest.approx(6 * FAST_S, abs=1e-4)
    assert sixth["staleness_weight"][slow] == pytest.approx((1 + 5) ** -0.5)


@pytest.mark.network
def test_a_fixed_deadline_passes_in_simulated_time(
    tmp_path: Path, mosquitto: MosquittoBroker
) -> None:
    # Execute: synchronous rounds with a 5 s deadline (+0.5 s grace) the slow device misses
    train, slow, fast = run(
        tmp_path, mosquitto.port, rounds=2, deadline_s=5.0, grace_s=0.5, min_replies=2
    )

    # Assert: each step waits out its deadline in simulated time, the fast replies timed on it
    assert len(train) == 2
    for record in train:
        assert record["failed"] == {slow: "deadline"}
        assert sorted(record["agents"]) == sorted(set(record["participants"]) - {slow})
        assert record["duration_s"] == pytest.approx(5.5)
        assert record["reply_s"][fast] == pytest.approx(FAST_S)
    assert train[1]["time"] - train[0]["time"] == pytest.approx(5.5, abs=1e-4)


@pytest.mark.network
def test_an_adaptive_deadline_follows_the_simulated_reply_times(
    tmp_path: Path, mosquitto: MosquittoBroker
) -> None:
    # Execute: adaptive deadlines, at least 1 s, at most 60 s
    train, slow, _fast = run(
        tmp_path,
        mosquitto.port,
        rounds=4,
        deadline_mode="adaptive",
        deadline_s=60.0,
        deadline_min_s=1.0,
    )

    # Assert: once five reply times are in, each deadline is p90 x 1.5 of the simulated ones
    # (the slow device's 12 s among them: 18 s, which it makes), never of the real ones
    rule = DeadlineRule(60.0, adaptive=True, quantile=0.9, margin=1.5, floor_s=1.0)
    for record in train:
        assert record["deadline_s"] == pytest.approx(rule.next().seconds)
        assert record["failed"] == {}
        rule.observe(record["reply_s"], [])
    assert [r["deadline_s"] for r in train] == pytest.approx([60.0, 60.0, 18.0, 18.0])
    assert train[2]["reply_s"][slow] == pytest.approx(SLOW_S)


def test_a_profiled_reply_is_scheduled_after_its_measured_compute_times_the_speed() -> None:
    # Prepare: a coordinator and one device 10x slower on a memory broker, a fake host clock
    broker, topics = MemoryBroker(), Topics("fed")
    clock = SimulatedClock(settle_s=0.01)
    coordinator = clock.watch(MemoryTransport(broker, "coordinator"), topics)
    inbox: queue.Queue[bytes] = queue.Queue()
    coordinator.subscribe(topics.up("d1", "reply"), lambda _t, payload: inbox.put(payload))
    coordinator.connect()
    host = [100.0]
    profile = DeviceProfile(speed=10.0, delay_s=0.5, uplink_bps=8000.0)  # 1 ms a byte
    device = ProfiledTransport(
        MemoryTransport(broker, "d1"),
        profile,
        topics,
        "d1",
        seed=0,
        clock=lambda: host[0],
        simulated=clock,
    )
    device.subscribe(topics.down("d1", "task"), lambda _t, _p: None)
    device.connect()

    # Execute: the task goes out at simulated 0, takes 0.2 s on the host, 100 bytes go back
    coordinator.publish(topics.down("d1", "task"), b"task")
    host[0] += 0.2
    device.publish(topics.up("d1", "reply"), b"r" * 100)
    got = clock.take(inbox, 60.0, for_replies=True)

    # Assert: delivered at 0.5 + 10 x 0.2 + 0.5 + 0.1 simulated seconds, nothing slept
    assert got == [b"r" * 100]
    assert clock.monotonic() == pytest.approx(0.5 + 2.0 + 0.5 + 0.1)


def test_a_wait_with_nothing_due_jumps_to_its_end_and_other_waits_stay_real() -> None:
    clock = SimulatedClock(settle_s=0.01)
    inbox: queue.Queue[int] = queue.Queue()
    assert clock.take(inbox, 30.0, for_replies=True) == []
    assert clock.monotonic() == pytest.approx(30.0)
    assert clock.take(inbox, 0.01) == []  # waiting for agents: real time, the clock stays
    assert clock.monotonic() == pytest.approx(30.0)


def test_simulate_with_a_simulated_clock_records_the_profiles_delays_without_waiting_them(
    tmp_path: Path,
) -> None:
    # Prepare: every device 50 s away each way (a step of 100 s and more, were it waited out)
    profile = tmp_path / "far.toml"
    profile.write_text("[default]\ndelay_s = 50.0\n")
    run_dir = tmp_path / "run"

    # Execute: the in-memory transport, as `coordinator simulate` runs by default
    code = cli_main(
        [
            "simulate",
            "--agents",
            "2",
            "--rounds",
            "2",
            "--models",
            "mlp_s",
            "--profile",
            str(profile),
            "--clock",
            "simulated",
            "--global-test-size",
            "50",
            "--run-dir",
            str(run_dir),
        ]
    )

    # Assert: every step took its 100 simulated seconds and more, one after the other
    assert code == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3  # two rounds and the final step
    for record in records:
        assert record["duration_s"] >= 100.0
        assert min(record["reply_s"].values()) >= 100.0
    times = [r["time"] for r in records]
    assert all(later - earlier >= 100.0 for earlier, later in itertools.pairwise(times))


def test_a_simulated_clock_is_refused_with_the_ray_backend(tmp_path: Path) -> None:
    cfg = load_config(None, [], algorithm="fedproto", rounds=1, run_dir=str(tmp_path / "run"))
    fleet = FleetSpec(num_agents=2, models=("mlp_s",), data="digits", feature_dim=8)
    with pytest.raises(ConfigError, match="only with the in-process backend"):
        simulate(cfg, fleet, backend="ray", clock=SimulatedClock())
