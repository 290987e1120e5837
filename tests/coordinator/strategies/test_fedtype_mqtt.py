"""FedType end to end over a real Mosquitto with 3 agents of different private architectures.

Every frame any party publishes is recorded on its way to the broker, decoded and checked
against the spec's message table (fedtype.md §3.1, §3.3): round start = the global proxy (none
in round 1: every agent starts from the fleet's seeded p_g^0), upload = the trained proxy with
n_i = |D_i| and the round's metrics, and the global proxy is the n_i-weighted mean of the last
round's uploads. No frame may carry a tensor of a private model: checked by name and shape
against the proxy's layout, by value against every private model as it was at each upload, and
by size.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import coordinator.strategies.fedtype
import edge_agent.algorithms.fedtype  # registers the edge half before agents are built
from coordinator.config import RunConfig
from coordinator.engine.runner import coordinator_will, make_coordinator
from coordinator.sim.simulate import FleetSpec, agent_options, agent_will
from edge_agent.factory import build_agent
from models import create_model
from protocol.contract.codec import Envelope, decode
from protocol.contract.messages import Knowledge, Register, Reply, Task
from protocol.contract.payloads import TensorMap
from protocol.transport.paho import MqttTransport
from tests.coordinator.strategies.test_fedvtc_mqtt import RecordingMqtt, Wire
from tests.helpers_runtime import run_config

assert coordinator.strategies.fedtype and edge_agent.algorithms.fedtype
pytestmark = [pytest.mark.network, pytest.mark.slow]

ROUNDS, C, VAL = 3, 10, 0.25
FLEET = FleetSpec(
    num_agents=3,
    models=("mlp_w", "cnn_fc", "mlp_xl"),  # three private architectures (§10's pool)
    data="digits",
    partition="dirichlet:1.0",
    feature_dim=None,
    global_test_size=200,
)
AGENTS = ["agent0", "agent1", "agent2"]
PROXY = {
    k: tuple(v.shape)
    for k, v in create_model("mlp_xs", num_classes=C, in_chans=1, input_size=8).state_dict().items()
}
PROXY_BYTES = 4 * sum(int(np.prod(s)) for s in PROXY.values())  # 2,410 params
Snapshots = dict[str, list[dict[str, np.ndarray]]]  # device -> private model at each upload


def config(tmp_path: Path) -> RunConfig:
    cfg = run_config(tmp_path, "fedtype", rounds=ROUNDS, run_id="fedtype-mqtt")
    hyper = {"proxy_model": "mlp_xs", "local_epochs": 2, "lr": 1e-3, "val_fraction": VAL}
    return cfg.replace(hyper={**cfg.hyper, **hyper, "raps_k_reg": 2})


def tensor_maps(env: Envelope) -> list[TensorMap]:
    body = env.body
    if isinstance(body, (Task, Reply, Knowledge)):
        return [p for p in body.payloads.values() if isinstance(p, TensorMap)]
    return []


def private_leaks(maps: list[TensorMap], private: Snapshots) -> list[str]:
    """Tensors on the wire that are not the proxy's (name, shape) or equal a private tensor."""
    values = {
        (a.shape, a.tobytes()) for snaps in private.values() for s in snaps for a in s.values()
    }
    leaks = []
    for m in maps:
        for name, a in m.tensors.items():
            if PROXY.get(name) != tuple(a.shape):
                leaks.append(f"{name}{list(a.shape)} is not a proxy tensor")
            elif a.size > 1 and (a.shape, a.astype(np.float32).tobytes()) in values:
                leaks.append(f"{name} carries a private model's values")
    return leaks


def start_agents(
    cfg: RunConfig, port: int, frames: list[tuple[str, bytes]], lock: threading.Lock
) -> tuple[list[tuple[MqttTransport, threading.Thread]], Snapshots, threading.Event]:
    """The fleet over Mosquitto; each upload also snapshots the device's private model."""
    stop, agents, private = threading.Event(), [], {a: [] for a in AGENTS}
    for i in range(FLEET.num_agents):
        opts = agent_options(cfg, FLEET, i)
        will = agent_will(cfg.federation, opts.device_id)
        t = RecordingMqtt(frames, lock, client_id=f"edgefl-{opts.device_id}", port=port, will=will)
        agent = build_agent(opts, t)
        algo, upload = agent.algorithm, agent.algorithm.reply_payloads

        def spy(algo: Any = algo, upload: Any = upload, device: str = opts.device_id) -> Any:
            state = algo.ctx.model.state_dict()
            private[device].append({k: v.detach().cpu().numpy().copy() for k, v in state.items()})
            return upload()

        algo.reply_payloads = spy
        t.connect()
        agent.start()
        thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
        thread.start()
        agents.append((t, thread))
    return agents, private, stop


Sent = list[tuple[str, Envelope, int]]  # (topic, decoded frame, bytes)


def run_over_mosquitto(port: int, tmp_path: Path) -> tuple[Any, Sent, Snapshots]:
    cfg = config(tmp_path)
    frames: list[tuple[str, bytes]] = []
    lock = threading.Lock()
    agents, private, stop = start_agents(cfg, port, frames, lock)
    ct = RecordingMqtt(
        frames, lock, client_id="edgefl-coordinator", port=port, will=coordinator_will(cfg)
    )
    try:
        coord = make_coordinator(cfg, ct)
        coord.start()
        ct.connect()
        result = coord.run()
        coord.store.close()
        ct.close()
    finally:
        stop.set()
        for t, thread in agents:
            thread.join(timeout=30)
            t.close()
    with lock:
        sent = [(topic, decode(data), len(data)) for topic, data in frames]
    return result, sent, private


def check_upload(wire: Wire, r: int, held: dict[str, int]) -> None:
    """§3.3: the trained proxy (every tensor, exact float32), n_i = |D_i|, the metrics."""
    for device, reply in wire.replies[(r, "train")].items():
        assert set(reply.payloads) == {"weights"}
        w = reply.payloads["weights"]
        assert isinstance(w, TensorMap) and w.encoding == "raw"
        assert {k: tuple(v.shape) for k, v in w.tensors.items()} == PROXY
        assert all(v.dtype == np.float32 for v in w.tensors.values())
        n = held[device]
        assert reply.num_samples == n - round(VAL * n)
        for key in ("acc_local", "proxy_acc", "global_proxy_acc", "mean_eta", "mean_set_size"):
            assert 0 <= reply.metrics[key] <= C, key
        assert reply.metrics["sets_not_nested"] == 0


def check_round_start(wire: Wire, r: int, phase: str = "train") -> None:
    """§3.1: nothing in round 1; then the n_i-weighted mean of last round's proxies."""
    for task in wire.tasks[(r, phase)].values():
        assert task.algorithm == "fedtype" and task.config["proxy_model"] == "mlp_xs"
        if r == 1:
            assert task.payloads == {}
            continue
        assert set(task.payloads) == {"weights"}
        g = task.payloads["weights"]
        assert isinstance(g, TensorMap)
        ups = list(wire.replies[(r - 1, "train")].values())
        n = np.array([u.num_samples for u in ups], np.float64)
        for name, value in g.tensors.items():
            maps = [u.payloads["weights"] for u in ups]
            expect = sum(
                ni / n.sum() * m.tensors[name].astype(np.float64)
                for ni, m in zip(n, maps, strict=True)
                if isinstance(m, TensorMap)
            )
            np.testing.assert_allclose(value, expect, rtol=1e-5, atol=1e-6)


def test_private_leak_detector_can_fail() -> None:
    private = {"a": [{"head.bias": np.arange(10, dtype=np.float32)}]}
    ok = TensorMap({k: np.zeros(s, np.float32) for k, s in PROXY.items()})
    assert private_leaks([ok], private) == []
    leaked = TensorMap({**ok.tensors, "head.bias": np.arange(10, dtype=np.float32)})
    assert private_leaks([leaked], private) == ["head.bias carries a private model's values"]
    extra = TensorMap({"trunk.3.weight": np.zeros((512, 64), np.float32)})
    assert private_leaks([extra], private) == ["trunk.3.weight[512, 64] is not a proxy tensor"]


def test_fedtype_over_mosquitto_only_the_proxy_travels(mosquitto, tmp_path: Path) -> None:
    # Execute
    result, sent, private = run_over_mosquitto(mosquitto.port, tmp_path)
    wire = Wire(sent)
    held = {
        env.sender: env.body.total_samples() for _, env, _ in sent if isinstance(env.body, Register)
    }
    # Assert: the plan ran and every frame matches the message table
    steps = result.metrics
    assert [(m["round"], m["phase"]) for m in steps] == [
        (r, "train") for r in range(1, ROUNDS + 1)
    ] + [(ROUNDS + 1, "final")]
    for r in range(1, ROUNDS + 1):
        assert sorted(wire.replies[(r, "train")]) == AGENTS
        check_upload(wire, r, held)
        check_round_start(wire, r)
        wire.counted(steps[r - 1], "tx", r, "train")
        wire.counted(steps[r - 1], "rx", r, "train")
    check_round_start(wire, ROUNDS + 1, "final")
    assert all(r.payloads == {} for r in wire.replies[(ROUNDS + 1, "final")].values())
    # no private tensor on the wire: by name and shape, by value, by size
    assert all(len(s) == ROUNDS for s in private.values())  # one snapshot per upload
    maps = [m for _, env, _ in sent for m in tensor_maps(env)]
    firsts = [*wire.tasks.values(), *wire.replies.values()]
    count = sum("weights" in m.payloads for by_device in firsts for m in by_device.values())
    assert count == 3 * ROUNDS + 3 * ROUNDS  # uploads; tasks of rounds 2.. and the final
    # every frame is checked, resent copies too: the uploads, and the proxy each later step
    # sends down once on bcast/knowledge for all its tasks
    assert len(maps) >= 3 * ROUNDS + ROUNDS
    assert private_leaks(maps, private) == []
    smallest_private = min(4 * sum(a.size for a in s[0].values()) for s in private.values())
    assert smallest_private > 10 * PROXY_BYTES
    model_frames = [n for _, env, n in sent if tensor_maps(env)]
    assert max(model_frames) < PROXY_BYTES + 4096 < smallest_private
    final = steps[-1]["agents"]
    assert all(0 <= m["global_proxy_acc"] <= 1 for m in final.values())
