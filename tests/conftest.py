"""Fixtures shared by every test suite: real brokers for the ``network`` tests.

``mosquitto`` starts Debian's mosquitto on a free loopback port for one test (about 15 ms)
and yields a :class:`coordinator.broker.embedded.MosquittoBroker` (``.host``, ``.port``,
``.stop()``,
``.start()`` to restart on the same port). ``embedded_broker`` does the same with the
in-process amqtt broker. ``mosquitto_tls`` runs mosquitto with what ``coordinator provision``
wrote (mutual TLS, per-device ACL) for the devices in :data:`TLS_DEVICES`; ``fleet_broker``
runs the same fleet on mosquitto and on the embedded broker in turn; ``wss_broker`` runs it
with the WebSockets listener of ``provision --ws-port`` too. Without mosquitto the tests skip,
except in CI (``CI`` set), where a missing broker is a failure: CI installs it, so a skip there
would hide a broken set-up. A mosquitto built without WebSockets skips the WebSockets tests on
it, saying so.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pwd
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.broker.embedded import (
    BrokerFiles,
    EmbeddedBroker,
    MosquittoBroker,
    free_port,
    mosquitto_executable,
)
from protocol.errors import EdgeFLError


def pytest_configure(config: pytest.Config) -> None:
    """A suite started as a background job (``cmd &`` without job control) inherits SIGINT
    ignored, and so would every command the tests start: Ctrl-C tests would see it ignored.
    Python's own handler here makes the commands start with the default disposition."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _missing(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: install it instead of skipping)")
    pytest.skip(reason)


@pytest.fixture
def mosquitto() -> Iterator[MosquittoBroker]:
    """A running mosquitto on 127.0.0.1 with a free port, killed on teardown."""
    if mosquitto_executable() is None:
        _missing("mosquitto is not installed (apt-get install mosquitto)")
    broker = MosquittoBroker()
    broker.start()
    try:
        yield broker
    finally:
        broker.cleanup()


@pytest.fixture
def embedded_broker() -> Iterator[EmbeddedBroker]:
    """The in-process amqtt broker on a free loopback port."""
    try:
        import amqtt  # noqa: F401
    except ImportError:
        _missing("amqtt is not installed (pip install edgefl[broker])")
    with EmbeddedBroker() as broker:
        yield broker


TLS_FEDERATION = "tls"
TLS_DEVICES = ("agent0", "agent1", "agent2")


class ProvisionedMosquitto(MosquittoBroker):
    """mosquitto with the provisioned ``broker/mosquitto.conf``, read again at every start
    (so that a restart after ``provision revoke`` loads the new CRL)."""

    flavour = "mosquitto"

    def __init__(self, root: Path, port: int) -> None:
        super().__init__(port=port)
        self.root = root
        self.ws_port = BrokerFiles.open(root / "broker").websocket_port()

    def start(self) -> ProvisionedMosquitto:
        """Start, and wait for the WebSockets listener too (opened after the first)."""
        super().start()
        if self.ws_port is not None:
            deadline = time.monotonic() + self.start_timeout
            while not _accepts(self.ws_port) and time.monotonic() < deadline:
                time.sleep(0.05)
        return self

    def config_text(self) -> str:
        conf = (self.root / "broker" / "mosquitto.conf").read_text()
        return conf + "log_dest stderr\nlog_type error\nlog_type warning\nlog_type notice\n"

    def reload(self) -> None:
        """SIGHUP: mosquitto reads its ACL and CRL again (``systemctl reload mosquitto``)."""
        if self._proc is None:
            raise RuntimeError("mosquitto is not running")
        self._proc.send_signal(signal.SIGHUP)

    def kit(self, name: str) -> Path:
        """A device's kit directory, or the coordinator's (``"coordinator"``)."""
        return self.root / name if name == "coordinator" else self.root / "devices" / name


class ProvisionedEmbedded(EmbeddedBroker):
    """The embedded amqtt broker on the provisioned ``broker/`` directory, with the same
    test-facing methods as :class:`ProvisionedMosquitto`."""

    flavour = "embedded"

    def __init__(self, root: Path, port: int) -> None:
        files = BrokerFiles.open(root / "broker")  # its WebSockets listener too, as serve's
        super().__init__(port=port, fleet=files, ws_port=files.websocket_port())
        self.root = root

    def reload(self) -> None:
        """Nothing to signal: the broker reads the CRL again when the file changes."""

    kit = ProvisionedMosquitto.kit

    def cleanup(self) -> None:
        self.stop()


ProvisionedBroker = ProvisionedMosquitto | ProvisionedEmbedded


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
        return True
    return False


def _system_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


@contextlib.contextmanager
def provisioned_fleet(*, broker_user: str = "", websockets: bool = False) -> Iterator[Path]:
    """A fleet provisioned by ``coordinator provision`` for :data:`TLS_DEVICES` whose broker
    listens on a free loopback port (``ProvisionSpec.port``), with ``websockets`` a WebSockets
    listener on another (``ws_port``); deleted afterwards."""
    pytest.importorskip("cryptography")
    from coordinator.ops.provision import ProvisionSpec, provision

    # not pytest's tmp_path (mode 0700): mosquitto, started as root, drops to its own user and
    # must still reach broker/; it also gets the server key, as `--broker-user` does in production
    root = Path(tempfile.mkdtemp(prefix="edgefl-fleet-"))
    root.chmod(0o755)
    spec = ProvisionSpec(
        federation=TLS_FEDERATION,
        devices=TLS_DEVICES,
        hostnames=("127.0.0.1", "localhost"),
        port=free_port(),
        ws_port=free_port() if websockets else 0,
        listen="127.0.0.1",
        broker_user=broker_user,
    )
    try:
        provision(root, spec)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _provisioned(flavour: str, *, websockets: bool = False) -> Iterator[ProvisionedBroker]:
    """A provisioned fleet and its mutual-TLS broker, running (``websockets``: with its
    WebSockets listener too)."""
    if flavour == "mosquitto" and mosquitto_executable() is None:
        _missing("mosquitto is not installed (apt-get install mosquitto)")
    if flavour == "mosquitto" and websockets:
        _skip_without_mosquitto_websockets()
    mosquitto_user = flavour == "mosquitto" and os.geteuid() == 0 and _system_user("mosquitto")
    user = "mosquitto" if mosquitto_user else ""
    with provisioned_fleet(broker_user=user, websockets=websockets) as root:
        port = BrokerFiles.open(root / "broker").listener()[0]
        cls = ProvisionedMosquitto if flavour == "mosquitto" else ProvisionedEmbedded
        broker = cls(root, port)
        try:
            broker.start()
            yield broker
        finally:
            broker.cleanup()


@pytest.fixture
def mosquitto_tls() -> Iterator[ProvisionedBroker]:
    """The provisioned fleet on Mosquitto (the production broker)."""
    yield from _provisioned("mosquitto")


@pytest.fixture
def embedded_tls() -> Iterator[ProvisionedBroker]:
    """The provisioned fleet on the embedded broker alone (rules Mosquitto does not have)."""
    yield from _provisioned("embedded")


@pytest.fixture(params=["mosquitto", "embedded"])
def fleet_broker(request: pytest.FixtureRequest) -> Iterator[ProvisionedBroker]:
    """The provisioned fleet on each broker the toolkit runs: both must enforce its rules."""
    yield from _provisioned(request.param)


@pytest.fixture
def mosquitto_wss() -> Iterator[ProvisionedBroker]:
    """The provisioned fleet on Mosquitto, with its WebSockets-over-TLS listener."""
    yield from _provisioned("mosquitto", websockets=True)


@pytest.fixture(params=["mosquitto", "embedded"])
def wss_broker(request: pytest.FixtureRequest) -> Iterator[ProvisionedBroker]:
    """The provisioned fleet with its WebSockets-over-TLS listener, on each broker."""
    yield from _provisioned(request.param, websockets=True)


@functools.cache
def mosquitto_websockets_error() -> str:
    """Why the local mosquitto cannot serve MQTT over WebSockets ("" when it can): probed once,
    by starting it with a ``protocol websockets`` listener (a build without WebSockets, such
    as some distributions ship, refuses to start with one)."""
    probe = MosquittoBroker(extra_config=f"listener {free_port()} 127.0.0.1\nprotocol websockets\n")
    try:
        probe.start()
    except EdgeFLError as exc:
        errors = [line for line in str(exc).splitlines() if "rror" in line]
        return errors[0] if errors else str(exc).splitlines()[0]
    finally:
        probe.cleanup()
    return ""


def _skip_without_mosquitto_websockets() -> None:
    error = mosquitto_websockets_error()
    if error:  # not a broken set-up: a build choice, so no failure in CI either
        pytest.skip(
            f"{mosquitto_executable()} is built without WebSockets support: a `protocol "
            f"websockets` listener does not start ({error})"
        )
