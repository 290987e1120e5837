"""Device profiles: the file, the seeded assignment, the transport that delays and drops a
device's replies, and a simulated run in which one device always drops out."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.config import load_config
from coordinator.sim.profile import (
    DeviceProfile,
    FleetProfile,
    ProfiledTransport,
    ProfileGroup,
    load_profile,
)
from coordinator.sim.simulate import FleetSpec, simulate
from protocol.contract.topics import Topics
from protocol.errors import ConfigError
from protocol.transport.base import MemoryBroker, MemoryTransport

EXAMPLE = """
seed = 3

[[group]]
share = 0.2
speed = 10.0

[[group]]
share = 0.1
dropout = 1.0

[default]
delay_s = 0.05
uplink_bps = 1e6
"""


def test_a_profile_file_reads_its_groups_and_default(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(EXAMPLE)
    profile = load_profile(path)
    assert profile.seed == 3
    assert [g.share for g in profile.groups] == [0.2, 0.1]
    assert profile.groups[0].profile.speed == 10.0 and profile.groups[1].profile.dropout == 1.0
    assert profile.default == DeviceProfile(delay_s=0.05, uplink_bps=1e6)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[default]\nspeeed = 2\n", "unknown keys"),
        ("[[group]]\nshare = 0.7\n[[group]]\nshare = 0.6\n", "sum to <= 1"),
        ("[default]\nspeed = 0.5\n", "speed >= 1"),
        ("[default]\ndropout = 1.5\n", r"dropout must be in \[0, 1\]"),
        ("[fleet]\n", "unknown tables"),
    ],
)
def test_a_wrong_profile_is_refused_with_what_is_wrong(
    tmp_path: Path, text: str, match: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_profile(path)


def test_the_assignment_gives_each_group_its_share_seeded() -> None:
    slow = DeviceProfile(speed=10.0)
    gone = DeviceProfile(dropout=1.0)
    profile = FleetProfile((ProfileGroup(0.2, slow), ProfileGroup(0.1, gone)))
    a = profile.assign(20, seed=1)
    assert a.count(slow) == 4 and a.count(gone) == 2 and a.count(DeviceProfile()) == 14
    assert profile.assign(20, seed=1) == a
    assert profile.assign(20, seed=2) != a  # another run seed: other devices are slow


def test_a_speed_spread_varies_each_device_and_never_speeds_one_up() -> None:
    profile = FleetProfile((ProfileGroup(1.0, DeviceProfile(speed=2.0), speed_sigma=1.0),))
    speeds = [p.speed for p in profile.assign(200, seed=0)]
    assert min(speeds) >= 1.0 and max(speeds) > 4.0 and len(set(speeds)) > 100


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def profiled(profile: DeviceProfile, clock: Clock) -> tuple[ProfiledTransport, MemoryTransport]:
    broker = MemoryBroker()
    coordinator = MemoryTransport(broker, "coordinator")
    coordinator.connect()
    agent = ProfiledTransport(
        MemoryTransport(broker, "dev1"),
        profile,
        Topics("fed"),
        "dev1",
        seed=0,
        sleep=clock.sleep,
        clock=clock,
    )
    agent.connect()
    return agent, coordinator


def test_a_reply_waits_for_the_slower_compute_latency_and_upload_once_per_task() -> None:
    # Prepare: 10x slower, 50 ms each way, 8 kbit/s up
    clock = Clock()
    agent, coordinator = profiled(DeviceProfile(speed=10, delay_s=0.05, uplink_bps=8000), clock)
    topics = Topics("fed")
    got: list[bytes] = []
    coordinator.subscribe(topics.up("dev1", "reply"), lambda t, p: got.append(p))
    agent.subscribe(topics.down("dev1", "#"), lambda t, p: None)
    # Execute: a task, 2 s of compute here, the reply (1000 bytes), then a resend
    coordinator.publish(topics.down("dev1", "task"), b"task")
    clock.now += 2.0
    agent.publish(topics.up("dev1", "reply"), b"r" * 1000)
    agent.publish(topics.up("dev1", "reply"), b"r" * 1000)
    agent.publish(topics.up("dev1", "progress"), b"p")  # not a reply: not held back
    # Assert: 9 x 2 s + 2 x 0.05 s + 1 s upload, then the upload alone
    assert clock.slept == pytest.approx([18.0 + 0.1 + 1.0, 1.0])
    assert len(got) == 2


def test_a_dropped_task_loses_its_reply_and_every_resend_until_the_next_task() -> None:
    clock = Clock()
    agent, coordinator = profiled(DeviceProfile(dropout=1.0), clock)
    topics = Topics("fed")
    got: list[str] = []
    coordinator.subscribe(f"{topics.base}/dev/dev1/up/#", lambda t, p: got.append(t))
    agent.subscribe(topics.down("dev1", "#"), lambda t, p: None)
    coordinator.publish(topics.down("dev1", "task"), b"task")
    agent.publish(topics.up("dev1", "reply"), b"r")
    agent.publish(topics.up("dev1", "reply"), b"r")
    agent.publish(topics.up("dev1", "register"), b"g")
    assert got == [topics.up("dev1", "register")]
    assert agent.dropped_tasks == 1


def test_a_simulated_run_goes_on_without_a_device_that_always_drops_out(tmp_path: Path) -> None:
    # Prepare: 3 agents, one of which never delivers a reply; a short deadline closes each step
    # with the other two (quorum: half of the selected)
    cfg = load_config(
        None,
        ["hyper.local_epochs=1"],
        algorithm="fedproto",
        rounds=2,
        run_dir=str(tmp_path / "run"),
        min_agents=3,
        deadline_s=4.0,
        max_retries=0,
        run_id="test-profile",
    )
    gone = DeviceProfile(dropout=1.0)
    fleet = FleetSpec(
        num_agents=3,
        models=("cnn_t1", "mlp_s", "cnn_t2"),
        global_test_size=60,
        profile=FleetProfile((ProfileGroup(1 / 3, gone),)),
    )
    dropped = [i for i, p in enumerate(fleet.profile.assign(3, cfg.seed)) if p == gone]  # type: ignore[union-attr]
    # Execute
    result = simulate(cfg, fleet)
    # Assert: every training step closed with the two others, never with the dropped device
    train = [m for m in result.metrics if m["phase"] == "train"]
    assert len(dropped) == 1 and len(train) == 2
    for step in train:
        assert sorted(step["agents"]) == sorted(
            {"agent0", "agent1", "agent2"} - {f"agent{dropped[0]}"}
        )
