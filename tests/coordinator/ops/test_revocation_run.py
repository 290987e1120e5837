"""``coordinator provision revoke`` during a run: the running coordinator drops the device.

``coordinator serve --kit`` over the provisioned mutual-TLS Mosquitto, three scripted devices
speaking the real protocol with their kits (TLS, signed frames). agent2 answers round 1, then
goes silent while its connection stays open (Mosquitto checks the CRL only at a handshake); the
test revokes it when its round-2 task arrives. With an hour's deadline, the run can end only if
the coordinator stops waiting for agent2 in round 2 and does not select it for the final step.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from coordinator.ops.provision import add_devices, revoke_devices
from coordinator.ops.revocation import REVOKED_FILE, RevocationWatch, kit_revocations
from protocol.contract.codec import Envelope
from protocol.contract.messages import (
    CoordinatorState,
    Reply,
    Task,
)
from protocol.contract.payloads import PrototypeSet
from protocol.contract.topics import Topics
from protocol.security.credentials import load_credentials
from protocol.security.keys import load_signing
from protocol.transport.endpoint import Endpoint
from protocol.transport.paho import MqttTransport
from tests.conftest import TLS_FEDERATION, ProvisionedBroker, provisioned_fleet
from tests.helpers_mqtt import fedproto_register
from tests.helpers_runtime import clean_env

pytestmark = [pytest.mark.network, pytest.mark.slow]

BIN = Path(sys.executable).parent
T = Topics(TLS_FEDERATION)
AGENT_UNSIGNED = frozenset({"coord_state"})  # the coordinator's last will (edge_agent.factory)


class KitDevice:
    """A device with a kit's TLS and signing keys, answering each task as ``answers`` says
    (``None``: no answer), recording the tasks it got."""

    def __init__(self, broker: ProvisionedBroker, kit: Path, device_id: str, *, silent_from: int):
        self.device_id, self.silent_from = device_id, silent_from
        creds = load_credentials(kit=kit, env={})
        signing = load_signing(creds, device_id)
        assert signing is not None, "the kit has signing keys"
        self.transport = MqttTransport(
            client_id=f"edgefl-{TLS_FEDERATION}-{device_id}",
            port=broker.port,
            **creds.transport_options(),
        )
        self.endpoint = Endpoint(
            self.transport,
            sender=device_id,
            federation=TLS_FEDERATION,
            **signing.endpoint_options(AGENT_UNSIGNED),
        )
        self.tasks: list[tuple[str, int]] = []
        self.silenced = threading.Event()  # set at its first task left unanswered
        self.endpoint.subscribe(f"{T.base}/dev/{device_id}/down/#", self._on_message)

    def start(self) -> KitDevice:
        self.endpoint.subscribe(T.coord_state, self._on_state)
        self.transport.connect()
        return self

    def _on_state(self, env: Envelope, topic: str) -> None:
        """Register when the coordinator starts, as an agent does."""
        if not isinstance(env.body, CoordinatorState) or env.body.state != "starting":
            return
        self.endpoint.send(T.up(self.device_id, "register"), fedproto_register(self.device_id))

    def _on_message(self, env: Envelope, topic: str) -> None:
        task = env.body
        if not isinstance(task, Task):
            return
        self.tasks.append((task.phase, task.round))
        if task.phase == "train" and task.round >= self.silent_from:
            self.silenced.set()
            return
        protos = PrototypeSet(
            np.array([0, 1]),
            np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32),
            np.array([5, 5]),
        )
        reply = Reply(
            task_id=task.task_id,
            round=task.round,
            phase=task.phase,
            num_samples=10,
            payloads={"protos": protos} if task.phase == "train" else {},
        )
        self.endpoint.send(T.up(self.device_id, "reply"), reply, round=task.round)

    def close(self) -> None:
        self.endpoint.close()
        self.transport.close()


def test_a_device_revoked_mid_run_is_no_longer_waited_for_nor_selected(
    mosquitto_tls: ProvisionedBroker, tmp_path: Path
) -> None:
    # Prepare: the coordinator of the shipped command; agent2 keeps its kit (revoke deletes it)
    b = mosquitto_tls
    run_dir = tmp_path / "run"
    kept = shutil.copytree(b.kit("agent2"), tmp_path / "agent2")
    serve = [
        str(BIN / "coordinator"),
        "serve",
        "--kit",
        str(b.kit("coordinator")),
        "--algorithm",
        "fedproto",
        "--rounds",
        "2",
        "--run-dir",
        str(run_dir),
        "--set",
        "run.min_agents=3",
        "run.deadline_s=3600",
    ]
    log = (tmp_path / "coord.log").open("w")
    coord = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT, env=clean_env())
    devices = [
        KitDevice(b, b.kit("agent0"), "agent0", silent_from=99),
        KitDevice(b, b.kit("agent1"), "agent1", silent_from=99),
        KitDevice(b, kept, "agent2", silent_from=2),
    ]
    try:
        for device in devices:
            device.start()
        # Execute: revoke agent2 once it holds its round-2 task and stays silent
        assert devices[2].silenced.wait(120), (tmp_path / "coord.log").read_text()
        revoke_devices(b.root, ["agent2"])
        # a bound on a hang, within the test's 300 s: the step's deadline is an hour away
        code = coord.wait(150)
    finally:
        if coord.poll() is None:
            coord.kill()
            coord.wait()
        log.close()
        for device in devices:
            device.close()
    output = (tmp_path / "coord.log").read_text()
    # Assert: the run finished; round 2 closed with the two devices left, the final step
    # selected only them, and agent2 got no task after the revocation
    assert code == 0, output
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["phase"], r["round"]) for r in records] == [
        ("train", 1),
        ("train", 2),
        ("final", 3),
    ]
    assert [sorted(r["agents"]) for r in records] == [
        ["agent0", "agent1", "agent2"],
        ["agent0", "agent1"],
        ["agent0", "agent1"],
    ]
    assert devices[2].tasks == [("train", 1), ("train", 2)]
    assert "agent agent2 revoked" in output and "no longer waits for it" in output, output


def test_the_revocation_list_follows_revoke_and_a_reissue() -> None:
    """``provision revoke`` lists the device in the coordinator's kit, where a watcher sees
    it; ``provision add`` of the same id (a new certificate) takes it off again."""
    with provisioned_fleet() as root:
        kit = load_credentials(kit=root / "coordinator", env={}).kit
        path = kit_revocations(kit)
        assert path == root / "coordinator" / REVOKED_FILE
        watch = RevocationWatch(path, logging.getLogger("test"), poll_s=0)
        assert watch.poll() == frozenset()
        assert watch.poll() is None  # unchanged since
        revoke_devices(root, ["agent2"])
        assert watch.poll() == frozenset({"agent2"})
        add_devices(root, ["agent2"])
        assert watch.poll() == frozenset()
