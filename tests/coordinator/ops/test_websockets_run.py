"""Whole runs with the shipped commands over MQTT over WebSockets with the kits' mutual TLS.

``coordinator serve --kit`` and two ``edge-agent --kit --broker wss://...`` processes: the
agents reach the broker only through its WebSockets-over-TLS listener (``provision
--ws-port``). On Mosquitto the coordinator connects over ``wss://`` too (its default lean
client speaks TCP only: paho takes over); on the
embedded broker (``serve --broker-dir``) the coordinator stays on the TLS listener, and a
client without a certificate of the fleet is refused on the WebSockets one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import wait_for

from coordinator.broker.embedded import BrokerFiles
from protocol.errors import ConnectError
from protocol.transport.paho import MqttTransport, TlsOptions
from tests.conftest import ProvisionedBroker, provisioned_fleet
from tests.coordinator.ops.test_tls_run import (
    _listening,
    agent_cmd,
    assert_both_agents_trained,
    serve_cmd,
)
from tests.helpers_runtime import Fleet, clean_env

pytestmark = [pytest.mark.network, pytest.mark.slow]


def start_wss_agents(fleet: Fleet, kits: Path, url: str, tmp_path: Path) -> None:
    for i in range(2):
        argv = [*agent_cmd(kits / f"agent{i}", i, tmp_path / f"agent{i}"), "--broker", url]
        fleet.start(f"a{i}", argv, clean_env())


def test_fedavg_over_mosquittos_websockets_listener_with_kits(
    mosquitto_wss: ProvisionedBroker, tmp_path: Path
) -> None:
    # Prepare
    url = f"wss://127.0.0.1:{mosquitto_wss.ws_port}/mqtt"
    run_dir, fleet = tmp_path / "run", Fleet(tmp_path)
    serve = serve_cmd(mosquitto_wss.kit("coordinator"), run_dir, "--broker", url)
    # Execute
    fleet.start("coord", serve, clean_env())
    start_wss_agents(fleet, mosquitto_wss.root / "devices", url, tmp_path)
    codes = fleet.wait()
    # Assert: the run finished with both agents in both rounds, everyone over WebSockets
    assert_both_agents_trained(fleet, codes, run_dir)
    assert "MQTT over WebSockets: the paho client" in fleet.log("coord"), fleet.log("coord")
    assert all(f"connected to {url}" in fleet.log(name) for name in ("coord", "a0", "a1"))


def test_serve_runs_the_fleets_broker_with_its_websockets_listener(tmp_path: Path) -> None:
    """``coordinator serve --broker-dir`` serves the broker directory's WebSockets listener too:
    agents over ``wss://`` train; a client without a certificate of the fleet is refused there."""
    with provisioned_fleet(websockets=True) as root:
        # Prepare
        run_dir, fleet = tmp_path / "run", Fleet(tmp_path)
        ws_port = BrokerFiles.open(root / "broker").websocket_port()
        assert ws_port is not None
        serve = serve_cmd(root / "coordinator", run_dir, "--broker-dir", str(root / "broker"))
        # Execute
        fleet.start("coord", serve, clean_env())
        start_wss_agents(fleet, root / "devices", f"wss://localhost:{ws_port}/mqtt", tmp_path)
        assert wait_for(lambda: _listening(ws_port), 60), fleet.logs()
        ca = TlsOptions(ca_certs=str(root / "broker" / "ca.crt"))
        intruder = MqttTransport(
            client_id="intruder", port=ws_port, websocket_path="/mqtt", tls=ca, connect_timeout=5
        )
        with pytest.raises(ConnectError):
            intruder.connect()
        intruder.close()
        codes = fleet.wait()
    # Assert
    assert_both_agents_trained(fleet, codes, run_dir)
    assert f"MQTT over WebSockets on wss://127.0.0.1:{ws_port}" in fleet.log("coord")
