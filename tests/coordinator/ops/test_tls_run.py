"""Whole runs with the shipped commands over a provisioned, mutual-TLS broker.

``coordinator serve --kit`` and two ``edge-agent --kit`` processes, nothing else: broker
address, federation, device ids and TLS files come from the kits. The broker has only its TLS
listener, so a finished run proves the kits carry everything. A password given through the
environment (mTLS ignores it) must appear in no file the run writes. The broker is Mosquitto,
then the coordinator's own embedded broker on the provisioned broker directory.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
from pathlib import Path

import pytest
from helpers import wait_for

from coordinator.broker.embedded import BrokerFiles
from protocol.errors import ConnectError
from protocol.security.credentials import ENV
from protocol.transport.paho import MqttTransport, TlsOptions
from tests.conftest import ProvisionedBroker, provisioned_fleet
from tests.helpers_runtime import (
    Fleet,
    clean_env,
    fedavg_agent_args,
    stored_rows,
    worker_counts,
)

pytestmark = [pytest.mark.network, pytest.mark.slow]

BIN = Path(sys.executable).parent
SECRET = "do-not-store-this-password"


def serve_cmd(kit: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        str(BIN / "coordinator"),
        "serve",
        "--kit",
        str(kit),
        *extra,
        "--algorithm",
        "fedavg",
        "--rounds",
        "2",
        "--run-dir",
        str(run_dir),
        "--set",
        "run.min_agents=2",
        "run.deadline_s=300",
        "hyper.local_epochs=1",
    ]


def agent_cmd(kit: Path, i: int, state: Path) -> list[str]:
    return [str(BIN / "edge-agent"), "--kit", str(kit), *fedavg_agent_args(i, state)]


def start_agents(fleet: Fleet, kits: Path, tmp_path: Path, env: dict[str, str]) -> None:
    for i in range(2):
        kit = kits / f"agent{i}"
        fleet.start(f"a{i}", agent_cmd(kit, i, tmp_path / f"agent{i}"), env)


def assert_both_agents_trained(fleet: Fleet, codes: dict[str, int], run_dir: Path) -> None:
    assert codes == {"coord": 0, "a0": 0, "a1": 0}, fleet.logs()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if m.get("phase", "train") == "train"]
    assert [m["round"] for m in train][:2] == [1, 2]
    assert all(sorted(m["agents"]) == ["agent0", "agent1"] for m in train[:2])
    assert json.loads((run_dir / "run.json").read_text())["federation"] == "tls"


def test_fedavg_over_mtls_with_kits_stores_no_secret(
    mosquitto_tls: ProvisionedBroker, tmp_path: Path
) -> None:
    # Prepare
    env = clean_env(**{ENV["password"]: SECRET})
    run_dir, fleet = tmp_path / "run", Fleet(tmp_path)
    # Execute
    fleet.start("coord", serve_cmd(mosquitto_tls.kit("coordinator"), run_dir), env)
    start_agents(fleet, mosquitto_tls.root / "devices", tmp_path, env)
    codes = fleet.wait()
    # Assert: the run finished with both agents in both rounds
    assert_both_agents_trained(fleet, codes, run_dir)
    coord_log = fleet.log("coord")
    assert "EDGEFL_MQTT_PASSWORD" in coord_log and "kit " in coord_log  # said where from
    # no secret in anything the run or the agents wrote (config dump, SQLite store, logs)
    for path in [*tmp_path.rglob("*")]:
        if path.is_file():
            data = path.read_bytes()
            assert SECRET.encode() not in data, path
            assert b"PRIVATE KEY" not in data, path


@pytest.mark.parametrize("spawned", [True, False], ids=["spawned", "by-hand"])
def test_ingest_workers_with_the_coordinator_kit_take_the_replies(
    mosquitto_tls: ProvisionedBroker, tmp_path: Path, spawned: bool
) -> None:
    """``serve --kit --spawn-workers``, or ``ingest-worker --kit`` started by hand: the worker
    signs as the coordinator and must verify the coordinator's own signed state to go online."""
    # Prepare
    env, run_dir, fleet = clean_env(), tmp_path / "run", Fleet(tmp_path)
    kit = mosquitto_tls.kit("coordinator")
    serve = serve_cmd(kit, run_dir, *(["--spawn-workers"] if spawned else []))
    worker = [str(BIN / "coordinator"), "ingest-worker", "--kit", str(kit), "--id", "w1"]
    worker += ["--run-dir", str(run_dir), "--broker", f"127.0.0.1:{mosquitto_tls.port}"]
    # Execute
    fleet.start("coord", [*serve, "run.ingest_workers=1"], env)
    if not spawned:
        fleet.start("w1", worker, env)
    start_agents(fleet, mosquitto_tls.root / "devices", tmp_path, env)
    codes = fleet.wait()
    # Assert: the run finished, and every reply stored was taken by the worker
    worker_log = run_dir / "ingest" / "w1.log" if spawned else tmp_path / "w1.log"
    assert codes.pop("w1", 0) == 0, fleet.logs() + worker_log.read_text()
    assert_both_agents_trained(fleet, codes, run_dir)
    rows = stored_rows(run_dir)
    assert {device for _, device, _ in rows} == {"agent0", "agent1"}
    assert worker_counts(worker_log)["stored"] == len(rows), worker_log.read_text()


def test_serve_runs_the_fleets_broker_itself_from_the_broker_directory(tmp_path: Path) -> None:
    """``coordinator serve --kit OUT/coordinator --broker-dir OUT/broker``: no Mosquitto, the
    embedded broker enforces the provisioned mutual TLS; a client without a certificate of the
    fleet is refused while the run goes on."""
    with provisioned_fleet() as root:
        # Prepare
        env, run_dir, fleet = clean_env(), tmp_path / "run", Fleet(tmp_path)
        port = BrokerFiles.open(root / "broker").listener()[0]
        serve = serve_cmd(root / "coordinator", run_dir, "--broker-dir", str(root / "broker"))
        # Execute
        fleet.start("coord", serve, env)
        start_agents(fleet, root / "devices", tmp_path, env)
        ca = str(root / "broker" / "ca.crt")
        assert wait_for(lambda: _listening(port), 60), fleet.logs()
        refused = [_refused(port, None), _refused(port, TlsOptions(ca_certs=ca))]
        codes = fleet.wait()
    # Assert
    assert refused == [True, True]
    assert_both_agents_trained(fleet, codes, run_dir)
    assert "mutual TLS, ACL of" in fleet.log("coord"), fleet.log("coord")


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
        return True
    return False


def _refused(port: int, tls: TlsOptions | None) -> bool:
    t = MqttTransport(client_id="intruder", port=port, connect_timeout=3, tls=tls)
    try:
        t.connect()
    except ConnectError:
        return True
    finally:
        t.close()
    return False
