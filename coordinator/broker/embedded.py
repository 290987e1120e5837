"""Brokers to run next to a coordinator: embedded amqtt (pure Python) or a local Mosquitto.

:class:`EmbeddedBroker` runs amqtt (MQTT 3.1.1) in-process on its own asyncio loop in a
background thread: zero set-up, good for demos and small federations (~2k QoS 1 msg/s).
:class:`MosquittoBroker` starts the ``mosquitto`` executable on a loopback port from a
generated config file: the fast, real broker used by the integration tests and benchmarks.
Both are context managers exposing ``host`` and ``port``; ``port=0`` picks a free port. The
embedded broker can also serve MQTT over WebSockets (``ws_port``; any request path), over TLS
with a fleet's rules.

Both listen on ``127.0.0.1`` unless given another ``host``. Given a broker directory of
``coordinator provision`` (:class:`BrokerFiles`), the embedded broker enforces that fleet's
rules as the generated Mosquitto config does: mutual TLS with the fleet's CA and CRL, the
certificate's CN as username, and the ``acl`` file (:mod:`coordinator.broker.plugins`). Without
one it authenticates nobody and warns when it listens on a non-loopback interface
(``docs/concepts/security.md``).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from protocol.errors import ConfigError, EdgeFLError
from protocol.security.mode import is_loopback

__all__ = [
    "BrokerFiles",
    "EmbeddedBroker",
    "MosquittoBroker",
    "SnapshotDict",
    "free_port",
    "mosquitto_executable",
]

_QUIET_LOGGERS = ("amqtt", "transitions")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_listening(
    host: str, port: int, deadline: float, alive: Callable[[], bool] | None = None
) -> bool:
    """Poll until ``host:port`` accepts connections, the deadline passes or ``alive()`` is false."""
    probe_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            return False
        try:
            with socket.create_connection((probe_host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.01)
    return False


@dataclass(frozen=True, slots=True)
class BrokerFiles:
    """The broker directory ``coordinator provision`` writes (``OUT/broker``)."""

    directory: Path

    NAMES = ("ca.crt", "server.crt", "server.key", "crl.pem", "acl", "mosquitto.conf")

    @classmethod
    def open(cls, directory: str | Path) -> BrokerFiles:
        """Check that every file is there; a missing one is a :class:`ConfigError` naming it."""
        d = Path(directory)
        missing = [name for name in cls.NAMES if not (d / name).is_file()]
        if missing:
            raise ConfigError(
                f"broker directory {d}: missing {', '.join(missing)}; expected the OUT/broker "
                "directory of `coordinator provision`"
            )
        return cls(d)

    def path(self, name: str) -> str:
        """One of :attr:`NAMES` as a string path."""
        return str(self.directory / name)

    def listener(self) -> tuple[int, str]:
        """Port and interface of the MQTT ``listener`` in ``mosquitto.conf`` (all interfaces,
        ``0.0.0.0``, when it names none, as Mosquitto reads it)."""
        for port, host, protocol in self._listeners():
            if protocol == "mqtt":
                return port, host
        raise ConfigError(f"{self.directory / 'mosquitto.conf'}: no `listener PORT [HOST]` line")

    def websocket_port(self) -> int | None:
        """Port of the ``listener`` with ``protocol websockets`` in ``mosquitto.conf``, if any
        (``coordinator provision --ws-port``)."""
        return next((p for p, _host, protocol in self._listeners() if protocol != "mqtt"), None)

    def _listeners(self) -> list[tuple[int, str, str]]:
        """``(port, interface, protocol)`` of each ``listener`` block of ``mosquitto.conf``."""
        found: list[tuple[int, str, str]] = []
        for line in (self.directory / "mosquitto.conf").read_text().splitlines():
            words = line.split()
            if len(words) in (2, 3) and words[0] == "listener" and words[1].isdigit():
                found.append((int(words[1]), words[2] if len(words) == 3 else "0.0.0.0", "mqtt"))
            elif len(words) == 2 and words[0] == "protocol" and found:
                found[-1] = (*found[-1][:2], words[1])
        return found


class SnapshotDict(dict[str, Any]):
    """amqtt's map of subscriptions (``Broker._subscriptions``), walked over a snapshot.

    amqtt 0.12 walks the map with an ``await`` inside the loop (a connecting client's retained
    messages, every broadcast), so a client that subscribed meanwhile raised "dictionary
    changed size during iteration": the connecting client was dropped, or the broadcast loop
    ended. A snapshot holds the same entries in the same order.
    """

    def __iter__(self) -> Iterator[str]:
        return iter(list(super().keys()))

    def items(self) -> list[tuple[str, Any]]:  # type: ignore[override]
        return list(super().items())


class EmbeddedBroker:
    """amqtt running in a background thread with its own event loop.

    Args:
        host: Interface to listen on. The default keeps the broker on this machine; anything
            else (``0.0.0.0``: every interface) exposes a broker without authentication,
            where anyone on the network can read and steer the fleet, and is logged as a
            warning.
        port: TCP port; ``0`` picks a free one (read it back from :attr:`port`).
        fleet: A provisioned broker directory: mutual TLS, CN as username, the fleet's ACL.
        ws_port: Also serve MQTT over WebSockets on this port of ``host`` (``0``: a free one,
            read back from :attr:`ws_port`), over the fleet's mutual TLS with ``fleet``.
        start_timeout: Seconds to wait for the listener.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        fleet: BrokerFiles | None = None,
        ws_port: int | None = None,
        start_timeout: float = 10.0,
        logger: logging.Logger | None = None,
    ) -> None:
        self.host = host
        self.fleet = fleet
        self.port = port
        self.ws_port = ws_port
        self._requested_port = port
        self._requested_ws_port = ws_port
        self.start_timeout = start_timeout
        self.log = logger or logging.getLogger("edgefl.broker")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._broker: Any = None

    @property
    def running(self) -> bool:
        """Whether the broker is serving."""
        return self._broker is not None

    def start(self) -> EmbeddedBroker:
        """Start listening; returns ``self``.

        Raises:
            EdgeFLError: amqtt is not installed, or the port could not be bound.
        """
        if self._broker is not None:
            return self
        broker_cls = _import_amqtt(crlfile=self.fleet.path("crl.pem") if self.fleet else None)
        for level_name in _QUIET_LOGGERS:  # amqtt logs every connection at INFO
            logging.getLogger(level_name).setLevel(logging.WARNING)
        attempts = 3 if self._requested_port == 0 else 1
        if self._requested_ws_port == 0:
            attempts = 3
        for attempt in range(attempts):
            port = self._requested_port or free_port(self.host)
            ws_port = self._requested_ws_port
            if ws_port == 0:
                ws_port = free_port(self.host)
            try:
                self._start_on(broker_cls, port, ws_port)
                break
            except EdgeFLError:
                if attempt == attempts - 1:
                    raise  # a free port taken between probe and bind: try another one
        mode = f"mutual TLS, ACL of {self.fleet.directory}" if self.fleet else "no authentication"
        self.log.info(
            "embedded MQTT broker (amqtt) listening on %s:%d (%s)", self.host, self.port, mode
        )
        if self.ws_port is not None:
            scheme = "wss" if self.fleet else "ws"
            self.log.info(
                "  and MQTT over WebSockets on %s://%s:%d", scheme, self.host, self.ws_port
            )
        if self.fleet is None and not is_loopback(self.host):
            self.log.warning(
                "embedded MQTT broker listens on %s:%d without authentication: anyone who can "
                "reach it can read and steer the fleet; use Mosquitto with TLS and per-device "
                "ACLs on a network (docs/concepts/security.md)",
                self.host,
                self.port,
            )
        return self

    def _start_on(self, broker_cls: Any, port: int, ws_port: int | None) -> None:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(
            target=loop.run_forever, name="edgefl-embedded-broker", daemon=True
        )
        thread.start()
        config = self._config(port, ws_port)

        async def boot() -> Any:
            broker = broker_cls(config)  # binds to the running loop: build it on that loop
            broker._subscriptions = SnapshotDict(broker._subscriptions)
            await broker.start()
            return broker

        try:
            self._broker = asyncio.run_coroutine_threadsafe(boot(), loop).result(self.start_timeout)
        except Exception as exc:  # amqtt wraps bind errors in its own BrokerError
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=5)
            loop.close()
            ports = f"{port}" if ws_port is None else f"{port} and {ws_port} (WebSockets)"
            raise EdgeFLError(
                f"embedded MQTT broker could not listen on {self.host}:{ports}: {exc}"
            ) from exc
        self._loop, self._thread, self.port, self.ws_port = loop, thread, port, ws_port

    def _config(self, port: int, ws_port: int | None) -> dict[str, Any]:
        listener: dict[str, Any] = {"type": "tcp", "bind": f"{self.host}:{port}"}
        plugins: dict[str, Any] = {
            "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}
        }
        if self.fleet is not None:
            files = self.fleet
            listener.update(
                ssl=True,
                cafile=files.path("ca.crt"),
                certfile=files.path("server.crt"),
                keyfile=files.path("server.key"),
            )
            acl = {"acl_file": files.path("acl")}
            plugins = {
                "coordinator.broker.plugins.CertificateIdentityAuth": {
                    **acl,
                    "crl_file": files.path("crl.pem"),
                },
                "coordinator.broker.plugins.FleetAclTopics": acl,
            }
        listeners = {"default": listener}
        if ws_port is not None:  # the same TLS files and plugins: one fleet, two transports
            listeners["ws"] = {**listener, "type": "ws", "bind": f"{self.host}:{ws_port}"}
        return {"listeners": listeners, "plugins": plugins}

    def stop(self) -> None:
        """Shut the broker down and end its thread. Idempotent."""
        broker, loop, thread = self._broker, self._loop, self._thread
        if broker is None or loop is None or thread is None:
            return
        self._broker = None
        try:
            asyncio.run_coroutine_threadsafe(broker.shutdown(), loop).result(10)
        except Exception as exc:  # a broken shutdown must not hide the caller's own error
            self.log.warning("embedded broker shutdown: %s", exc)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        if not thread.is_alive():
            loop.close()

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _import_amqtt(*, crlfile: str | None = None) -> Any:
    """amqtt's broker class; with ``crlfile``, the fleet's (:mod:`coordinator.broker.fleet`):
    its TLS listener requires a client certificate of the listener's CA that this CRL does not
    revoke, it authenticates before touching any session, and filters retained messages."""
    try:
        from amqtt.broker import Broker
    except ImportError as exc:
        raise EdgeFLError(
            "the embedded MQTT broker needs amqtt: pip install edgefl[broker] "
            "(or point --broker at a running broker such as mosquitto)"
        ) from exc
    if crlfile is None:
        return Broker
    from coordinator.broker.fleet import fleet_broker_class

    return fleet_broker_class(crlfile)


def mosquitto_executable() -> str | None:
    """Path of the ``mosquitto`` executable, if installed (Debian puts it in /usr/sbin)."""
    found = shutil.which("mosquitto")
    if found:
        return found
    debian = Path("/usr/sbin/mosquitto")
    return str(debian) if debian.exists() else None


class MosquittoBroker:
    """A ``mosquitto`` process on a loopback port, for tests, benchmarks and demos.

    The config keeps no state (``persistence false``), logs to a file in its private
    temporary directory (readable through :meth:`log_text`), sets TCP_NODELAY and lifts the
    queue limit so persistent sessions keep every QoS 1 message while a client is away.
    :meth:`stop` then :meth:`start` restarts it on the same port.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_packet_size: int | None = None,
        extra_config: str = "",
        start_timeout: float = 10.0,
        executable: str | None = None,
    ) -> None:
        exe = executable or mosquitto_executable()
        if exe is None:
            raise ConfigError("mosquitto is not installed (Debian: apt-get install mosquitto)")
        self.executable = exe
        self.host = host
        self.port = port or free_port(host)
        self.max_packet_size = max_packet_size
        self.extra_config = extra_config
        self.start_timeout = start_timeout
        self._dir = Path(tempfile.mkdtemp(prefix="edgefl-mosquitto-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The broker process's id while it runs (benchmarks read its CPU time)."""
        return self._proc.pid if self.running and self._proc is not None else None

    def config_text(self) -> str:
        """The mosquitto.conf this broker runs with."""
        lines = [
            f"listener {self.port} {self.host}",
            "allow_anonymous true",
            "persistence false",
            "set_tcp_nodelay true",
            "max_queued_messages 100000",
            "log_dest stderr",  # as root mosquitto drops to its own user: no root-owned log file
            "log_type error",
            "log_type warning",
            "log_type notice",
        ]
        if self.max_packet_size is not None:
            lines.append(f"max_packet_size {self.max_packet_size}")
        return "\n".join(lines) + "\n" + self.extra_config

    def start(self) -> MosquittoBroker:
        """Start the process and wait until it accepts connections; returns ``self``."""
        if self.running:
            return self
        conf = self._dir / "mosquitto.conf"
        conf.write_text(self.config_text())
        with (self._dir / "mosquitto.log").open("ab") as log:
            self._proc = subprocess.Popen(
                [self.executable, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=log
            )
        deadline = time.monotonic() + self.start_timeout
        if not _wait_listening(self.host, self.port, deadline, alive=lambda: self.running):
            self.stop()
            raise EdgeFLError(
                f"mosquitto did not start on {self.host}:{self.port}; its log:\n{self.log_text()}"
            )
        return self

    def stop(self) -> None:
        """Terminate the process (SIGTERM, then SIGKILL after 5 s). Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def log_text(self) -> str:
        """What mosquitto wrote to its log so far."""
        path = self._dir / "mosquitto.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def cleanup(self) -> None:
        """Stop and delete the temporary directory."""
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> MosquittoBroker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()
