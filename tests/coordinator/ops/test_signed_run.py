"""Signed control messages and retained ``coord_state`` (``docs/concepts/security.md``).

With the signing keys of a kit, ``coordinator serve`` and ``edge-agent`` sign every frame and
refuse unsigned ones, except the last wills, which only mark presence. The engine's part is
tested in-process; then two short runs with the shipped commands: over the provisioned mTLS
Mosquitto while a client holding device agent0's kit attacks, and over a plain Mosquitto
without ACL, where only the signatures stop a forged retained ``finished``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import wait_for

from coordinator.broker.embedded import MosquittoBroker
from coordinator.engine.core import Coordinator
from coordinator.engine.runner import make_coordinator
from coordinator.ops.provision import ProvisionSpec, provision
from protocol.contract.codec import Envelope, decode, decode_frame_map, encode
from protocol.contract.messages import CoordinatorState, Reply, Status
from protocol.contract.topics import Topics
from protocol.security.credentials import ENV, load_credentials
from protocol.security.keys import SigningKeys, load_signer
from protocol.security.signing import HmacSigner, Verifier
from protocol.transport.base import MemoryBroker, MemoryTransport
from protocol.transport.endpoint import Endpoint
from protocol.transport.paho import MqttTransport
from tests.conftest import TLS_FEDERATION, ProvisionedMosquitto
from tests.helpers_runtime import Fleet, clean_env, fedavg_agent_args, run_config

BIN = Path(sys.executable).parent
T = Topics(TLS_FEDERATION)
COORD_KEY = HmacSigner("coordinator", b"coordinator-secret-key")
AGENT_KEY = HmacSigner("agent0", b"agent-0-secret-key")


# -- the engine, in-process ----------------------------------------------------------------


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[tuple[Coordinator, MemoryBroker]]:
    """A signing coordinator on a memory broker, heartbeat at every pass of its loop."""
    broker = MemoryBroker()
    cfg = run_config(tmp_path, federation=TLS_FEDERATION, state_heartbeat_s=0.001)
    keys = SigningKeys(COORD_KEY, {"agent0": AGENT_KEY.verify_key()})
    coord = make_coordinator(cfg, MemoryTransport(broker, "coordinator"), signing=keys)
    coord.start()
    coord.endpoint.transport.connect()
    try:
        yield coord, broker
    finally:
        coord.store.close()


def _retained_state(broker: MemoryBroker) -> Envelope:
    frames: list[bytes] = []
    reader = MemoryTransport(broker, "late-joiner")
    reader.connect()
    reader.subscribe(T.coord_state, lambda t, d: frames.append(d))
    return Verifier({"coordinator": COORD_KEY.verify_key()}).verify(frames[-1])


def test_the_heartbeat_refreshes_the_signed_retained_state(
    coordinator: tuple[Coordinator, MemoryBroker],
) -> None:
    # Prepare
    coord, broker = coordinator
    first = _retained_state(broker)
    # Execute: one pass of the engine's loop once the interval has passed
    time.sleep(0.01)
    coord._pump(0.0)
    # Assert: the same state, signed again with a new id and a fresh timestamp
    again = _retained_state(broker)
    assert again.body == first.body and isinstance(again.body, CoordinatorState)
    assert again.msg_id != first.msg_id and again.ts > first.ts


def test_an_unsigned_status_can_only_mark_an_agent_offline(
    coordinator: tuple[Coordinator, MemoryBroker],
) -> None:
    # Prepare
    coord, broker = coordinator
    rogue = MemoryTransport(broker, "rogue")
    rogue.connect()
    agent_t = MemoryTransport(broker, "agent0")
    agent_t.connect()
    agent = Endpoint(agent_t, sender="agent0", federation=TLS_FEDERATION, signer=AGENT_KEY)

    def unsigned(state: str) -> None:
        body = Status(state=state)  # type: ignore[arg-type]
        env = Envelope(body=body, sender="agent0", federation=TLS_FEDERATION)
        rogue.publish(T.status("agent0"), encode(env))
        coord._pump(0.0)

    # Execute / Assert: forged "online" and "done" change nothing, a signed one counts, the
    # (unsigned) will takes the agent offline
    unsigned("online")
    assert "agent0" not in coord.online and coord.rejected == {"unsigned": 1}
    agent.send(T.status("agent0"), Status(state="online"))
    coord._pump(0.0)
    assert "agent0" in coord.online
    unsigned("done")
    assert "agent0" in coord.online and coord.rejected == {"unsigned": 2}
    unsigned("offline")
    assert "agent0" not in coord.online and coord.rejected == {"unsigned": 2}


# -- whole runs with the shipped commands ------------------------------------------------------


def _serve_args(run_dir: Path) -> list[str]:
    return [
        "--algorithm",
        "fedavg",
        "--rounds",
        "2",
        "--run-dir",
        str(run_dir),
        "--set",
        "run.min_agents=2",
        "run.deadline_s=120",
        "run.state_heartbeat_s=2",
        "hyper.local_epochs=1",
    ]


class StateWatch:
    """The coordinator states a client sees on the federation's retained topic."""

    def __init__(self, transport: MqttTransport) -> None:
        self.states: list[tuple[CoordinatorState, bool]] = []  # (state, signed)
        transport.subscribe(T.coord_state, self._on)

    def _on(self, _topic: str, data: bytes) -> None:
        obj = decode_frame_map(data)
        signed = "sm" in obj
        body = decode(obj["sm"] if signed else data).body
        if isinstance(body, CoordinatorState):
            self.states.append((body, signed))

    def seen(self, state: str) -> bool:
        return any(s.state == state and signed for s, signed in self.states)


def _finished(run_id: str = "run") -> CoordinatorState:
    return CoordinatorState(
        state="finished", run_id=run_id, algorithm="fedavg", round=2, total_rounds=2
    )


def _forged_reply(sender: str) -> Envelope:
    reply = Reply(
        task_id=f"run.0.0.{sender}", round=1, phase="train", num_samples=10**6, payloads={}
    )
    return Envelope(body=reply, sender=sender, federation=TLS_FEDERATION, round=1)


def _assert_completed(fleet: Fleet, codes: dict[str, int], run_dir: Path) -> None:
    assert codes == {"coord": 0, "a0": 0, "a1": 0}, fleet.logs()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    train = [m for m in map(_json, lines) if m.get("phase", "train") == "train"]
    assert [m["round"] for m in train] == [1, 2]
    assert all(sorted(m["agents"]) == ["agent0", "agent1"] for m in train), train
    assert "signing frames as coordinator" in fleet.log("coord"), fleet.log("coord")


def _json(line: str) -> dict[str, object]:
    import json

    out: dict[str, object] = json.loads(line)
    return out


@pytest.mark.network
@pytest.mark.slow
def test_signed_run_over_mtls_refuses_a_device_kit_holders_forgeries(
    mosquitto_tls: ProvisionedMosquitto, tmp_path: Path
) -> None:
    # Prepare: the run, and an intruder holding agent0's kit (certificate and signing key)
    b, run_dir, fleet = mosquitto_tls, tmp_path / "run", Fleet(tmp_path)
    kit_a = b.kit("agent0")
    creds = load_credentials(kit=kit_a, env={})
    intruder = MqttTransport(
        client_id="intruder", port=b.port, connect_timeout=5, **creds.transport_options()
    )
    watch = StateWatch(intruder)
    intruder.connect()
    signer_a = load_signer(kit_a / "signing.key", "agent0")
    env = clean_env()
    try:
        serve = [str(BIN / "coordinator"), "serve", "--kit", str(b.kit("coordinator"))]
        fleet.start("coord", serve + _serve_args(run_dir), env)
        for i in range(2):
            argv = [str(BIN / "edge-agent"), "--kit", str(b.kit(f"agent{i}"))]
            fleet.start(f"a{i}", argv + fedavg_agent_args(i, tmp_path / f"agent{i}"), env)
        assert wait_for(lambda: watch.seen("running"), 180), fleet.logs()
        # Execute: (a) an unsigned reply as agent0; (b) agent0's key signing a reply that
        # claims agent1, on agent0's topic (the signature check) and on agent1's (the ACL);
        # (c) a retained "finished", unsigned and signed with agent0's key
        intruder.publish(T.up("agent0", "reply"), encode(_forged_reply("agent0")))
        claim_b = signer_a.sign(encode(_forged_reply("agent1")))
        intruder.publish(T.up("agent0", "reply"), claim_b)
        intruder.publish(T.up("agent1", "reply"), claim_b)
        forged_end = Envelope(body=_finished(), sender="coordinator", federation=TLS_FEDERATION)
        intruder.publish(T.coord_state, encode(forged_end), retain=True)
        intruder.publish(T.coord_state, signer_a.sign(encode(forged_end)), retain=True)
        codes = fleet.wait()
    finally:
        intruder.close()
    # Assert: the run completed with both agents; the coordinator refused (a) and (b) itself;
    # the broker dropped the rest (no forged state reached anyone, the intruder included)
    _assert_completed(fleet, codes, run_dir)
    coord_log = fleet.log("coord")
    assert "unsigned 'reply' frame from 'agent0'" in coord_log
    assert "key 'agent0' cannot sign for sender 'agent1'" in coord_log
    assert all(signed for _s, signed in watch.states), watch.states


@pytest.fixture
def fleet_keys() -> Iterator[Path]:
    """A provisioned fleet used only for its signing keys (the broker below has no TLS)."""
    pytest.importorskip("cryptography")
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="edgefl-keys-"))
    provision(root, ProvisionSpec(federation=TLS_FEDERATION, devices=("agent0", "agent1")))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _keys_env(kit: Path) -> dict[str, str]:
    return clean_env(
        **{ENV["signing_key"]: str(kit / "signing.key"), ENV["verify_keys"]: str(kit / "verify")}
    )


@pytest.mark.network
@pytest.mark.slow
def test_without_acl_a_forged_retained_finished_stops_nobody(
    mosquitto: MosquittoBroker, fleet_keys: Path, tmp_path: Path
) -> None:
    # Prepare: anonymous plain MQTT, no ACL: anyone may write the retained state; the
    # participants have only their signing keys (EDGEFL_SIGNING_KEY, EDGEFL_VERIFY_KEYS)
    run_dir, fleet = tmp_path / "run", Fleet(tmp_path)
    broker = f"127.0.0.1:{mosquitto.port}"
    rogue = MqttTransport(client_id="rogue", port=mosquitto.port, connect_timeout=5)
    watch = StateWatch(rogue)
    rogue.connect()

    def forge(body: CoordinatorState) -> None:
        env = Envelope(body=body, sender="coordinator", federation=TLS_FEDERATION)
        rogue.publish(T.coord_state, encode(env), retain=True)

    serve = [str(BIN / "coordinator"), "serve", "--broker", broker]
    serve += [*_serve_args(run_dir), f"run.federation={TLS_FEDERATION}"]
    try:
        fleet.start("coord", serve, _keys_env(fleet_keys / "coordinator"))
        assert wait_for(lambda: watch.seen("starting"), 120), fleet.log("coord")
        # Execute: a forged end replaces the retained state before the agents start (they
        # must wait for the next signed heartbeat), and again once they joined the run
        forge(_finished())
        for i in range(2):
            argv = [str(BIN / "edge-agent"), "--broker", broker, "--id", f"agent{i}"]
            argv += ["--federation", TLS_FEDERATION, *fedavg_agent_args(i, tmp_path / f"agent{i}")]
            fleet.start(f"a{i}", argv, _keys_env(fleet_keys / "devices" / f"agent{i}"))
        assert wait_for(lambda: watch.seen("running"), 180), fleet.logs()
        forge(_finished())
        codes = fleet.wait()
    finally:
        rogue.close()
    # Assert: the run completed; the first forgery was replaced by a signed heartbeat, and
    # both agents, already in the run, received the second one and ignored it
    _assert_completed(fleet, codes, run_dir)
    forged = watch.states.index((_finished(), False))
    assert any(signed for _s, signed in watch.states[forged + 1 :]), watch.states
    for name in ("a0", "a1"):
        assert "ignored an unsigned coordinator state 'finished' of run run" in fleet.log(name)
