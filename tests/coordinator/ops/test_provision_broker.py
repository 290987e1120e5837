"""A provisioned fleet on a real Mosquitto in mutual-TLS mode, and on the embedded
broker given the same broker directory (``fleet_broker``, both in turn).

What the broker itself enforces with the files ``coordinator provision`` wrote: a device reads
only its own tasks and writes only as itself, an unprovisioned client cannot connect, and a
revoked device is refused once the broker restarts with the CRL.

Absence is checked with a fence, not a sleep: after the message that must not arrive, the
same publisher sends one that must, and Mosquitto delivers one publisher's QoS 1 messages in
order, so when the fence has arrived the forbidden message would have arrived before it.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import Inbox, wait_for

from coordinator.ops.provision import ProvisionSpec, provision, revoke_devices
from protocol.contract.topics import Topics
from protocol.errors import ConnectError, TransportError
from protocol.security.credentials import load_credentials
from protocol.transport.base import Will
from protocol.transport.lean_mqtt import LeanMqttTransport
from protocol.transport.mqtt_common import MqttClient
from protocol.transport.paho import MqttTransport, TlsOptions
from tests.conftest import TLS_FEDERATION, ProvisionedBroker

pytestmark = pytest.mark.network

T = Topics(TLS_FEDERATION)


@contextlib.contextmanager
def client(broker: ProvisionedBroker, kit: Path, client_id: str) -> Iterator[MqttTransport]:
    """A transport with a kit's credentials (connected on entry by the caller's subscribe)."""
    creds = load_credentials(kit=kit, env={})
    t = MqttTransport(
        client_id=client_id, port=broker.port, connect_timeout=5, **creds.transport_options()
    )
    try:
        yield t
    finally:
        t.close()


def _connect_refused(broker: ProvisionedBroker, tls: TlsOptions | None) -> None:
    t = MqttTransport(client_id="intruder", port=broker.port, connect_timeout=3, tls=tls)
    try:
        with pytest.raises(ConnectError):
            t.connect()
    finally:
        t.close()


def test_a_device_cannot_read_another_devices_tasks(fleet_broker: ProvisionedBroker) -> None:
    # Prepare: agent0 tries to listen on agent1's tasks and on everything; agent1 on its own
    b = fleet_broker
    spy, own, victim = Inbox(), Inbox(), Inbox()
    with (
        client(b, b.kit("coordinator"), "coord") as coord,
        client(b, b.kit("agent0"), "a0") as a0,
        client(b, b.kit("agent1"), "a1") as a1,
    ):
        a0.connect()
        for flt in (f"{T.base}/dev/agent1/down/#", f"{T.base}/#", "#"):
            with contextlib.suppress(TransportError):  # refused, or accepted and filtered
                a0.subscribe(flt, spy)
        a0.subscribe(f"{T.base}/dev/agent0/down/#", own)
        a1.subscribe(f"{T.base}/dev/agent1/down/#", victim)
        a1.connect()
        coord.connect()
        # Execute: a task for agent1, then the fence, a task for agent0
        coord.publish(T.down("agent1", "task"), b"task for agent1")
        coord.publish(T.down("agent0", "task"), b"task for agent0")
        # Assert
        assert victim.wait(1) and own.wait(1)
        assert victim.items[0][1] == b"task for agent1"
        assert [p for _t, p in spy.items if p == b"task for agent1"] == []


def test_a_device_cannot_publish_as_another_or_as_the_coordinator(
    fleet_broker: ProvisionedBroker,
) -> None:
    b = fleet_broker
    seen = Inbox()
    with (
        client(b, b.kit("coordinator"), "coord") as coord,
        client(b, b.kit("agent0"), "a0") as a0,
    ):
        for flt in (f"{T.base}/dev/+/up/#", f"{T.base}/dev/+/status", T.coord_state, T.round):
            coord.subscribe(flt, seen)
        coord.connect()
        a0.connect()
        # Execute: forgeries as agent1 and as the coordinator, then agent0's own reply (fence)
        a0.publish(T.up("agent1", "reply"), b"forged reply")
        a0.publish(T.status("agent1"), b"forged status", retain=True)
        a0.publish(T.coord_state, b"forged finished", retain=True)
        a0.publish(T.round, b"forged round", retain=True)
        a0.publish(T.up("agent0", "reply"), b"own reply")
        assert wait_for(lambda: any(p == b"own reply" for _t, p in seen.items), 5)
        assert [p for _t, p in seen.items] == [b"own reply"]
    # and nothing forged was retained for later subscribers
    late = Inbox()
    with client(b, b.kit("coordinator"), "late") as coord:
        coord.subscribe(T.coord_state, late)
        coord.subscribe(T.status("agent1"), late)
        coord.connect()
        coord.publish(T.coord_state, b"real state", retain=True)  # fence
        assert late.wait(1) and [p for _t, p in late.items] == [b"real state"]


def test_a_last_will_as_another_device_is_never_published(fleet_broker: ProvisionedBroker) -> None:
    # Prepare: agent0 connects with a retained will on agent1's status topic, then vanishes
    b = fleet_broker
    seen = Inbox()
    creds = load_credentials(kit=b.kit("agent0"), env={})
    forger = MqttTransport(
        client_id="a0-will",
        port=b.port,
        connect_timeout=3,
        will=Will(T.status("agent1"), b"forged offline"),
        **creds.transport_options(),
    )
    with client(b, b.kit("coordinator"), "coord") as coord:
        coord.subscribe(T.status("agent1"), seen)
        coord.subscribe(T.status("agent0"), seen)
        coord.connect()
        # Execute: refused at connect (embedded) or connected with a will the ACL drops
        with contextlib.suppress(ConnectError):
            forger.connect()
            forger.abort()
        forger.close()
        # Assert: agent0's own retained status is the fence; no forged status got through
        with client(b, b.kit("agent0"), "a0") as a0:
            a0.connect()
            a0.publish(T.status("agent0"), b"own status", retain=True)
            assert wait_for(lambda: any(p == b"own status" for _t, p in seen.items), 5)
        # the will comes from the broker noticing a dropped socket, not from a publisher the
        # fence is ordered after: give it a moment beyond the fence as well
        assert not wait_for(lambda: any(p == b"forged offline" for _t, p in seen.items), 1)
        assert [p for _t, p in seen.items] == [b"own status"]


def test_a_device_cannot_take_over_another_devices_session(fleet_broker: ProvisionedBroker) -> None:
    """agent1 connects with the client id of agent0's persistent session: it never receives
    agent0's tasks (the embedded broker refuses it outright; Mosquitto lets it in and its ACL
    drops agent0's topics at delivery)."""
    b = fleet_broker
    own, stolen = Inbox(), Inbox()
    with client(b, b.kit("agent0"), "shared-id") as a0:
        a0.subscribe(f"{T.base}/dev/agent0/down/#", own)
        a0.connect()
    with (
        client(b, b.kit("coordinator"), "coord") as coord,
        client(b, b.kit("agent1"), "shared-id") as thief,
    ):
        coord.connect()
        refused = False
        try:
            thief.subscribe(f"{T.base}/dev/agent0/down/#", stolen)
            thief.subscribe(f"{T.base}/dev/agent1/down/#", stolen)
            thief.connect()
        except ConnectError:
            refused = True

        def fence(payload: bytes) -> Callable[[], bool]:
            """agent1's own task, published until it arrives: then every subscription the
            thief sent on connecting is in place (they race the first publishes)."""

            def arrived() -> bool:
                coord.publish(T.down("agent1", "task"), payload)
                return wait_for(lambda: any(p == payload for _t, p in stolen.items), 0.2)

            return arrived

        # Execute: (when it got in) its subscriptions in place; a task for agent0; a second
        # fence, after which whatever the broker would deliver of that task has arrived
        if not refused:
            assert wait_for(fence(b"fence 1"), 10)
        coord.publish(T.down("agent0", "task"), b"task for agent0")
        if not refused:
            assert wait_for(fence(b"fence 2"), 10)
    # Assert
    assert b"task for agent0" not in [p for _t, p in stolen.items]
    assert refused or b.flavour == "mosquitto"  # the embedded broker refuses the takeover


def test_unprovisioned_clients_cannot_connect(fleet_broker: ProvisionedBroker) -> None:
    b = fleet_broker
    ca = str(b.root / "broker" / "ca.crt")
    _connect_refused(b, None)  # plain MQTT on the TLS port
    _connect_refused(b, TlsOptions(ca_certs=ca))  # TLS without a client certificate
    # a certificate from another CA, with a provisioned device's name
    other = Path(tempfile.mkdtemp(prefix="edgefl-other-"))
    try:
        provision(other, ProvisionSpec(federation=TLS_FEDERATION, devices=("agent0",)))
        kit = other / "devices" / "agent0"
        _connect_refused(
            b,
            TlsOptions(
                ca_certs=ca, certfile=str(kit / "device.crt"), keyfile=str(kit / "device.key")
            ),
        )
    finally:
        shutil.rmtree(other, ignore_errors=True)


def _connects(broker: ProvisionedBroker, kit: Path, client_id: str) -> bool:
    creds = load_credentials(kit=kit, env={})
    t = MqttTransport(
        client_id=client_id, port=broker.port, connect_timeout=3, **creds.transport_options()
    )
    try:
        t.connect()
    except ConnectError:
        return False
    finally:
        t.close()
    return True


def test_a_revoked_device_is_refused_after_a_reload_and_a_restart(
    fleet_broker: ProvisionedBroker, tmp_path: Path
) -> None:
    b = fleet_broker
    kept = shutil.copytree(b.kit("agent2"), tmp_path / "agent2")  # what the device still holds
    assert _connects(b, kept, "a2")  # Prepare: it works before
    # Execute: revoke, then reload (SIGHUP is asynchronous: poll until it took effect)
    revoke_devices(b.root, ["agent2"])
    b.reload()
    # Assert: agent2 is refused, agent0 still connects; and so after a restart
    assert wait_for(lambda: not _connects(b, kept, "a2"), 60, interval=0.2)
    assert _connects(b, b.kit("agent0"), "a0")
    b.stop()
    b.start()
    assert not _connects(b, kept, "a2")
    assert _connects(b, b.kit("agent0"), "a0")


def test_the_workers_share_group_passes_the_acl_and_no_device_can_join_it_blind(
    mosquitto_tls: ProvisionedBroker,
) -> None:
    # The workers log in with the coordinator's certificate and subscribe through the run's
    # random share group; the ACL's `{base}/#` for the coordinator covers it. A device that
    # joined the group would be handed its turn of the replies, which the ACL then refuses to
    # deliver (they are lost): it can only guess the group's name, and a guess is another group
    b = mosquitto_tls
    group = f"edgefl-ingest-{secrets.token_hex(16)}"
    workers, device = Inbox(), Inbox()
    with (
        client(b, b.kit("coordinator"), "edgefl-ingest-w1") as worker,
        client(b, b.kit("agent0"), "a0") as a0,
        client(b, b.kit("agent1"), "a1") as a1,
    ):
        worker.subscribe(f"$share/{group}/{T.base}/dev/+/up/reply", workers)
        worker.connect()
        for guess in ("edgefl-ingest", "edgefl-ingest-0"):
            with contextlib.suppress(TransportError):
                a1.subscribe(f"$share/{guess}/{T.base}/dev/+/up/reply", device)
        a1.connect()
        a0.connect()
        for i in range(6):
            a0.publish(T.up("agent0", "reply"), f"reply {i}".encode())
        assert workers.wait(6), workers.items
        assert [p for _t, p in workers.items] == [f"reply {i}".encode() for i in range(6)]
        assert device.items == []


class Eavesdropper(MqttTransport):
    """A client that records the topic of every message the broker sends it, including the
    ones no subscription of its own routes (the transport would drop those unseen)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.topics: list[str] = []

    def _on_message(self, client: Any, userdata: Any, msg: Any) -> None:
        self.topics.append(msg.topic)
        super()._on_message(client, userdata, msg)


def test_retained_messages_reach_only_a_reader_that_subscribed(
    fleet_broker: ProvisionedBroker,
) -> None:
    # Prepare: agent1's retained status, and the coordinator subscribed to every status (a
    # filter the broker now holds, which agent0's connection must not inherit)
    b = fleet_broker
    statuses, own = Inbox(), Inbox()
    with (
        client(b, b.kit("agent1"), "a1") as a1,
        client(b, b.kit("coordinator"), "coord") as coord,
    ):
        a1.connect()
        a1.publish(T.status("agent1"), b"agent1 online", retain=True)
        coord.subscribe(f"{T.base}/dev/+/status", statuses)
        coord.connect()
        assert statuses.wait(1), "agent1's status was not retained"
        creds = load_credentials(kit=b.kit("agent0"), env={})
        spy = Eavesdropper(
            client_id="a0", port=b.port, connect_timeout=5, **creds.transport_options()
        )
        try:
            # Execute: agent0 connects, asks for agent1's status (refused, or granted and
            # filtered), then its own tasks; a task for agent0 is the fence
            spy.connect()
            for flt in (T.status("agent1"), f"{T.base}/dev/+/status", "#"):
                with contextlib.suppress(TransportError):
                    spy.subscribe(flt, Inbox())
            spy.subscribe(f"{T.base}/dev/agent0/down/#", own)
            coord.publish(T.down("agent0", "task"), b"task for agent0")
            assert own.wait(1)
        finally:
            spy.close()
    # Assert: nothing of agent1's reached agent0's connection
    assert spy.topics == [T.down("agent0", "task")]


def test_a_refused_takeover_leaves_the_victims_session_untouched(
    embedded_tls: ProvisionedBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """The embedded broker refuses agent1 using agent0's client id: agent0 stays connected and
    keeps receiving its tasks (Mosquitto has no client id owners: see deploy-a-fleet.md)."""
    b = embedded_tls
    tasks = Inbox()
    with (
        caplog.at_level(logging.WARNING),
        client(b, b.kit("coordinator"), "coord") as coord,
        client(b, b.kit("agent0"), "shared-id") as victim,
        client(b, b.kit("agent1"), "shared-id") as thief,
    ):
        connects: list[bool] = []
        victim.add_connect_listener(connects.append)
        victim.subscribe(f"{T.base}/dev/agent0/down/#", tasks)
        victim.connect()
        coord.connect()
        coord.publish(T.down("agent0", "task"), b"task 1")
        assert tasks.wait(1)
        # Execute
        with pytest.raises(ConnectError, match="refused the session"):
            thief.connect()
        coord.publish(T.down("agent0", "task"), b"task 2")
        # Assert: the victim got its next task on the connection it had
        assert tasks.wait(2), "the victim's session was cut by a refused takeover"
        assert [p for _t, p in tasks.items] == [b"task 1", b"task 2"]
        assert victim.connected and len(connects) == 1, "the victim was disconnected"
    refusals = [r for r in caplog.records if "refused agent1" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in caplog.records]
    assert "client id 'shared-id' belongs to agent0" in refusals[0].getMessage()


def test_refused_clients_are_logged_in_one_line_each(
    embedded_tls: ProvisionedBroker, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    b = embedded_tls
    kept = shutil.copytree(b.kit("agent2"), tmp_path / "agent2")
    with caplog.at_level(logging.WARNING):
        revoke_devices(b.root, ["agent2"])
        for _ in range(3):  # a revoked device retrying, then a client without a certificate
            assert not _connects(b, kept, "a2")
        _connect_refused(b, TlsOptions(ca_certs=str(b.root / "broker" / "ca.crt")))
        assert _connects(b, b.kit("agent0"), "a0")  # the broker still serves
    lines = [r.getMessage() for r in caplog.records]
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert not [line for line in lines if "Traceback" in line or "\n" in line], lines


@pytest.mark.parametrize("transport", [MqttTransport, LeanMqttTransport], ids=["paho", "lean"])
def test_a_revoked_certificate_is_named_as_the_likely_cause(
    fleet_broker: ProvisionedBroker, tmp_path: Path, transport: type[MqttClient]
) -> None:
    # Prepare: agent2 revoked; the broker restarted with the new CRL
    b = fleet_broker
    kept = shutil.copytree(b.kit("agent2"), tmp_path / "agent2")
    revoke_devices(b.root, ["agent2"])
    b.stop()
    b.start()
    creds = load_credentials(kit=kept, env={})
    t = transport(client_id="a2", port=b.port, connect_timeout=5, **creds.transport_options())
    # Execute
    try:
        with pytest.raises(ConnectError) as refused:
            t.connect()
    finally:
        t.close()
    # Assert: the broker ended the TLS handshake, and the message says what that likely means
    message = str(refused.value)
    assert "closed the TLS connection during the handshake" in message, message
    assert "certificate revoked" in message and "MQTT broker?" not in message, message
