"""FedKTL end to end over a real Mosquitto.

Three in-process agents with different input specs: 8x8 grey, 12x12 grey and 8x8 RGB (digits
repeated into three channels through an ``.npz``; no RGB dataset of matching classes is
available offline). Every frame any party publishes is recorded on its way to the broker,
decoded and checked against the spec's message table (fedktl.md §3.0, §3.1, §3.3): the set-up
once per agent, also across an agent restart; from round 2 one uint8 image per class seen so
far at the agent's own resolution with float32 latents; unit-norm prototypes of the held
classes up. The coordinator's byte counts equal the recorded frames. A coordinator killed
mid-run and restarted continues with the same F, centroids, set-up holders and generator.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import coordinator.strategies.fedktl.strategy
import edge_agent.algorithms.fedktl  # noqa: F401  (registers both halves)
from coordinator.config import RunConfig
from coordinator.engine.runner import coordinator_will, make_coordinator
from coordinator.sim.simulate import FleetSpec, agent_options, agent_will
from coordinator.strategies.fedktl.strategy import FedKTLStrategy
from edge_agent.agent import EdgeAgent
from edge_agent.data import load_dataset
from edge_agent.factory import AgentOptions, build_agent
from protocol.algorithms.fedktl import setup_digest
from protocol.contract.codec import decode
from protocol.contract.payloads import ImageVectorPairs, PrototypeSet, TensorMap
from protocol.transport.paho import MqttTransport
from tests.coordinator.strategies.test_fedvtc_mqtt import RecordingMqtt, Wire
from tests.helpers_runtime import run_config

pytestmark = [pytest.mark.network, pytest.mark.slow]

_ = coordinator.strategies.fedktl.strategy
ROUNDS, C, KP = 3, 10, 16  # K = C: the agents' feature_dim
AGENTS = ["agent0", "agent1", "agent2"]
SPECS = {"agent0": (1, 8, 8), "agent1": (1, 12, 12), "agent2": (3, 8, 8)}
HYPER = {
    "generator": "cppn",
    "cppn_w_dim": 16,
    "cppn_resolution": 32,
    "server_epochs": 5,
    "feature_dim": KP,
    "batch_size": 16,
}
H = 16
FLEET = FleetSpec(
    num_agents=3,
    models=("mlp_s", "cnn_t1", "mlp_m"),
    data="digits",
    partition="dirichlet:1.0",
    feature_dim=C,
    global_test_size=200,
)


def config(tmp_path: Path) -> RunConfig:
    cfg = run_config(tmp_path, "fedktl", rounds=ROUNDS, run_id="fedktl-mqtt", min_agents=3)
    return cfg.replace(hyper={**cfg.hyper, **HYPER})


def rgb_digits(tmp_path: Path) -> str:
    """Digits as 3-channel images (the grey value in every channel), same order and labels."""
    ds = load_dataset("digits")
    path = tmp_path / "digits_rgb.npz"
    np.savez(path, x=np.repeat(ds.x, 3, axis=1), y=ds.y.astype(np.int64))
    return str(path)


def options(cfg: RunConfig, i: int, rgb: str) -> AgentOptions:
    opts = agent_options(cfg, FLEET, i)
    if i == 1:
        return dataclasses.replace(opts, image_size=12)
    if i == 2:
        return dataclasses.replace(opts, data=rgb)
    return opts  # type: ignore[no-any-return]


class Fleet:
    """The three agents over Mosquitto, each restartable from its state directory."""

    def __init__(self, cfg: RunConfig, port: int, rgb: str, transport: Callable[..., Any]):
        self.cfg, self.port, self.make = cfg, port, transport
        self.opts = [options(cfg, i, rgb) for i in range(3)]
        self.running: dict[int, tuple[EdgeAgent, Any, threading.Event, threading.Thread]] = {}

    def start(self, i: int) -> None:
        opts = self.opts[i]
        t = self.make(opts.device_id, agent_will(self.cfg.federation, opts.device_id))
        agent = build_agent(opts, t)
        t.connect()
        agent.start()
        stop = threading.Event()
        thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
        thread.start()
        self.running[i] = (agent, t, stop, thread)

    def stop(self, i: int, abort: bool = False) -> None:
        _, t, stop, thread = self.running.pop(i)
        stop.set()
        thread.join(timeout=60)
        t.abort() if abort else t.close()

    def close(self) -> None:
        for i in list(self.running):
            self.stop(i)


def recorder(
    port: int, frames: list[tuple[str, bytes]], lock: threading.Lock
) -> Callable[..., Any]:
    def make(client_id: str, will: Any) -> MqttTransport:
        return RecordingMqtt(frames, lock, client_id=f"edgefl-{client_id}", port=port, will=will)

    return make


def check_tasks(wire: Wire, r: int, seen: list[int]) -> None:
    """Set-up only in round 1; from round 2 the pairs of every class reported so far, at each
    agent's own input spec, with the same latents for everyone."""
    tasks = wire.tasks[(r, "train")]
    assert sorted(tasks) == AGENTS
    digests = {t.config["setup_sha256"] for t in tasks.values()}
    assert len(digests) == 1 and all(t.algorithm == "fedktl" for t in tasks.values())
    if r == 1:
        for task in tasks.values():
            assert set(task.payloads) == {"setup"}
            setup = task.payloads["setup"]
            assert isinstance(setup, TensorMap) and setup_digest(setup.tensors) in digests
            shapes = {k: (v.shape, v.dtype) for k, v in setup.tensors.items()}
            assert shapes == {
                "etf": ((C, C), np.float32),
                "proj.weight": ((H, KP), np.float32),
                "proj.bias": ((H,), np.float32),
            }
        return
    latents = []
    for device, task in tasks.items():
        assert set(task.payloads) == {"pairs"}
        pairs = task.payloads["pairs"]
        assert isinstance(pairs, ImageVectorPairs)
        assert pairs.images.dtype == np.uint8 and pairs.vectors.dtype == np.float32
        assert pairs.images.shape == (len(seen), *SPECS[device])
        assert pairs.vectors.shape == (len(seen), H)
        assert pairs.class_ids is not None and pairs.class_ids.dtype == np.int32
        assert pairs.class_ids.tolist() == seen and pairs.round == r - 1
        assert len({im.tobytes() for im in pairs.images}) == len(seen)  # one image per class
        latents.append(pairs.vectors)
    for other in latents[1:]:
        np.testing.assert_array_equal(other, latents[0])


def check_replies(wire: Wire, r: int) -> list[int]:
    """Unit-norm K-dim prototypes of exactly the held classes; returns the classes."""
    replies = wire.replies[(r, "train")]
    assert sorted(replies) == AGENTS
    for device, reply in replies.items():
        assert set(reply.payloads) == {"protos"}
        p = reply.payloads["protos"]
        assert isinstance(p, PrototypeSet) and p.class_ids.tolist() == wire.held[device]
        assert p.vectors.shape == (len(wire.held[device]), C) and p.vectors.dtype == np.float32
        np.testing.assert_allclose(np.linalg.norm(p.vectors, axis=1), 1.0, rtol=1e-5)
    return sorted({c for reply in replies.values() for c in reply.payloads["protos"].class_ids})  # type: ignore[union-attr]


def test_fedktl_over_mosquitto_with_three_input_specs_and_an_agent_restart(
    mosquitto: Any, tmp_path: Path
) -> None:
    # Prepare
    cfg = config(tmp_path)
    frames: list[tuple[str, bytes]] = []
    lock = threading.Lock()
    make = recorder(mosquitto.port, frames, lock)
    fleet = Fleet(cfg, mosquitto.port, rgb_digits(tmp_path), make)
    for i in range(3):
        fleet.start(i)
    coord_t = make("coordinator", coordinator_will(cfg))
    coord: Any = None
    restarted: list[int] = []

    def restart_agent1_after_round_one() -> None:
        if coord is not None and not restarted and coord.store.last_done_step() >= 0:
            fleet.stop(1, abort=True)  # abrupt: its round-2 task is sent again on re-register
            fleet.start(1)  # resumes from its checkpoint, set-up included
            restarted.append(1)

    # Execute
    try:
        coord = make_coordinator(cfg, coord_t, health_check=restart_agent1_after_round_one)
        coord.start()
        coord_t.connect()
        result = coord.run()
        coord.store.close()
    finally:
        fleet.close()
        coord_t.close()
    with lock:
        wire = Wire([(topic, decode(data), len(data)) for topic, data in frames])

    # Assert: the message table, round by round
    assert restarted == [1]
    steps = result.metrics
    assert [(m["round"], m["phase"]) for m in steps] == [
        (r, "train") for r in range(1, ROUNDS + 1)
    ] + [(ROUNDS + 1, "final")]
    seen: list[int] = []
    for r in range(1, ROUNDS + 1):
        check_tasks(wire, r, seen)
        seen = sorted(set(seen) | set(check_replies(wire, r)))
        wire.counted(steps[r - 1], "tx", r, "train")
        wire.counted(steps[r - 1], "rx", r, "train")
        assert steps[r - 1]["aggregate"]["ktl_classes"] == len(seen)
    # the set-up went to each agent exactly once, in its first task, restart included
    every_task = [(t, d) for (r, ph), ts in wire.tasks.items() for d, t in ts.items()]
    assert sorted(d for t, d in every_task if "setup" in t.payloads) == AGENTS
    assert all(t.payloads == {} for t in wire.tasks[(ROUNDS + 1, "final")].values())
    assert all(np.isfinite(a["acc_global"]) for a in steps[-1]["agents"].values())
    check_exports(fleet)


def check_exports(fleet: Fleet) -> None:
    """Each agent's final checkpoint exports with the cosine head and verifies against torch."""
    import json

    from export import export_bundle
    from models.checkpoint import load_checkpoint

    for opts in fleet.opts:
        ckpt_path = Path(opts.state_dir) / "checkpoint.pt"
        ckpt = load_checkpoint(ckpt_path)
        assert ckpt.head.type == "cosine" and ckpt.meta["phase"] == "final"
        ds = load_dataset(opts.data, image_size=opts.image_size)
        manifest = export_bundle(
            ckpt_path, Path(opts.state_dir) / "onnx", samples=ds.x[:32], labels=ds.y[:32]
        )
        fp32 = manifest.files[0]
        assert fp32.verification is not None and fp32.verification.passed
        assert json.loads((Path(opts.state_dir) / "onnx" / "manifest.json").read_text())


class CrashError(Exception):
    """Raised inside the coordinator's wait loop to kill it mid-run."""


def test_fedktl_coordinator_restart_continues_with_f_centroids_and_generator(
    mosquitto: Any, tmp_path: Path
) -> None:
    # Prepare: agents that outlive the first coordinator
    cfg = config(tmp_path)
    frames: list[tuple[str, bytes]] = []
    lock = threading.Lock()
    make = recorder(mosquitto.port, frames, lock)
    fleet = Fleet(cfg, mosquitto.port, rgb_digits(tmp_path), make)
    for i in range(3):
        fleet.start(i)
    first: Any = None

    def crash_after_two_rounds() -> None:
        if first is not None and first.store.last_done_step() >= 1:
            raise CrashError

    try:
        # Execute: the first coordinator dies while round 3 is open
        first_t = MqttTransport(
            client_id="edgefl-coordinator", port=mosquitto.port, will=coordinator_will(cfg)
        )
        first = make_coordinator(cfg, first_t, health_check=crash_after_two_rounds)
        first.start()
        first_t.connect()
        with pytest.raises(CrashError):
            first.run()
        at_crash = first.strategy.state_dict()
        first.store.close()
        first_t.abort()
        with lock:
            frames.clear()  # from here on: what the restarted coordinator and the agents send
        second_t = make("coordinator", coordinator_will(cfg))
        second = make_coordinator(cfg, second_t)
        restored = second.strategy
        restored_state = restored.state_dict()
        second.start()
        second_t.connect()
        result = second.run()
        second.store.close()
        second_t.close()
    finally:
        fleet.close()
    with lock:
        wire = Wire([(topic, decode(data), len(data)) for topic, data in frames])

    # Assert: the restart loaded exactly the state at the crash ...
    assert isinstance(restored, FedKTLStrategy)
    assert set(restored_state) == set(at_crash) == {"setup", "holders", "aligner", "generator"}
    for key, value in at_crash.items():
        other = restored_state[key]
        assert isinstance(value, TensorMap) and isinstance(other, TensorMap)
        assert value.tensors.keys() == other.tensors.keys()
        for name, arr in value.tensors.items():
            np.testing.assert_array_equal(arr, other.tensors[name])
    assert restored.holders == {a: 1 for a in AGENTS}
    # ... sent no set-up again, and kept training the same F
    assert not any("setup" in t.payloads for ts in wire.tasks.values() for t in ts.values())
    assert [(m["round"], m["phase"]) for m in result.metrics][-2:] == [
        (ROUNDS, "train"),
        (ROUNDS + 1, "final"),
    ]
    aligner_at_crash, final = at_crash["aligner"], restored.aligner
    assert isinstance(aligner_at_crash, TensorMap) and final is not None
    assert any(
        not np.array_equal(final.tensors[n], aligner_at_crash.tensors[n])
        for n in aligner_at_crash.tensors
    )
