"""Build and run a coordinator over any transport (used by serve, demo and simulate)."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator.config import RunConfig
from coordinator.engine.clock import Clock
from coordinator.engine.core import Coordinator, QuorumError, RunResult
from coordinator.engine.observer import RunObserver
from coordinator.store.connection import CHECKPOINT_S
from coordinator.store.database import Store
from coordinator.strategies import create_strategy
from coordinator.tracking import start_tracking
from protocol.contract.codec import Envelope, encode
from protocol.contract.messages import CoordinatorState, Status
from protocol.contract.topics import COORDINATOR_ID, Topics
from protocol.transport.base import Transport, Will
from protocol.transport.endpoint import Endpoint

if TYPE_CHECKING:
    from protocol.security.keys import SigningKeys
    from protocol.transport.lean_mqtt import LeanMqttTransport
    from protocol.transport.paho import MqttTransport

__all__ = [
    "coordinator_client_id",
    "coordinator_will",
    "make_coordinator",
    "mqtt_client",
    "mqtt_transport",
    "run_coordinator",
]

SENDER = COORDINATOR_ID
# what the coordinator accepts unsigned when it requires signatures: the agents' last wills,
# which the broker publishes long after they were made; the engine takes them as presence only
UNSIGNED_KINDS = frozenset({Status.KIND})


def coordinator_client_id(cfg: RunConfig) -> str:
    """The MQTT client id of the coordinator of this federation's run.

    A broker allows one connection per client id and hands a reconnecting id its old session:
    a fixed id made two coordinators (even of different federations) kick each other off and a
    new run inherit another run's queued messages. The run directory's path makes it unique per
    run; a resumed run keeps its id and so receives what the broker queued while it was down.
    """
    where = hashlib.sha256(str(Path(cfg.run_dir).resolve()).encode()).hexdigest()[:8]
    return f"edgefl-coord-{cfg.federation}-{cfg.run_id}-{where}"


def mqtt_transport(cfg: RunConfig, host: str, port: int, **options: Any) -> Transport:
    """The coordinator's MQTT transport (client id per run, retained ``offline`` will).

    ``run.mqtt_client`` picks the implementation (paho over WebSockets); ``options`` go to it
    (``username``, ``password``, ``tls``, ``websocket_path``:
    ``BrokerAddress.client_options()``).
    """
    client = mqtt_client(cfg, websockets=options.get("websocket_path") is not None)
    return client(
        host=host,
        port=port,
        client_id=coordinator_client_id(cfg),
        will=coordinator_will(cfg),
        **options,
    )


def mqtt_client(
    cfg: RunConfig, *, websockets: bool = False
) -> type[MqttTransport | LeanMqttTransport]:
    """The transport class ``run.mqtt_client`` names (imported only when asked for); paho for a
    broker reached over WebSockets (``ws://``, ``wss://``), which the lean client, a plain or
    TLS socket, does not speak."""
    if cfg.mqtt_client == "paho" or websockets:
        if cfg.mqtt_client != "paho":
            logging.getLogger("edgefl.coordinator").info(
                "MQTT over WebSockets: the paho client (run.mqtt_client=%s speaks TCP only)",
                cfg.mqtt_client,
            )
        from protocol.transport.paho import MqttTransport

        return MqttTransport
    from protocol.transport.lean_mqtt import LeanMqttTransport

    return LeanMqttTransport


def coordinator_will(cfg: RunConfig) -> Will:
    """Retained ``offline`` state the broker publishes if the coordinator vanishes."""
    body = CoordinatorState(
        state="offline",
        run_id=cfg.run_id,
        algorithm=cfg.algorithm,
        round=0,
        total_rounds=cfg.rounds,
        classes=list(cfg.classes),
    )
    return Will(
        Topics(cfg.federation).coord_state,
        encode(Envelope(body=body, sender=SENDER, federation=cfg.federation)),
    )


def make_coordinator(
    cfg: RunConfig,
    transport: Transport,
    logger: logging.Logger | None = None,
    *,
    health_check: Callable[[], None] | None = None,
    signing: SigningKeys | None = None,
    revocations: Path | None = None,
    observer: RunObserver | None = None,
    clock: Clock | None = None,
) -> Coordinator:
    """Lock the run directory, open its store and strategy and wire them to ``transport``.

    ``health_check`` runs before every wait for messages and may raise to end the run.
    ``signing``: sign every frame and refuse unsigned ones except the agents' wills (§7).
    ``revocations``: the coordinator kit's revocation list, watched during the run.
    ``observer``: told of the run's events (a metrics exporter).
    ``clock``: where the engine reads the time (default: real time; a simulation's clock).
    ``run.json`` is written once, when the run starts: a resumed run keeps its record.
    """
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    store = Store(run_dir / "state.sqlite", lock=True, checkpoint_s=CHECKPOINT_S)
    try:
        strategy = create_strategy(
            cfg.algorithm, cfg.algorithm_config(), num_classes=cfg.num_classes, seed=cfg.seed
        )
        if not (run_dir / "run.json").exists():
            (run_dir / "run.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        options = {} if signing is None else signing.endpoint_options(UNSIGNED_KINDS)
        endpoint = Endpoint(transport, sender=SENDER, federation=cfg.federation, **options)
        return Coordinator(
            cfg,
            endpoint,
            store,
            strategy,
            logger,
            health_check=health_check,
            revocations=revocations,
            observer=observer,
            clock=clock,
        )
    except BaseException:
        store.close()
        raise


def run_coordinator(
    cfg: RunConfig,
    transport: Transport,
    logger: logging.Logger | None = None,
    *,
    health_check: Callable[[], None] | None = None,
    signing: SigningKeys | None = None,
    revocations: Path | None = None,
    observer: RunObserver | None = None,
    clock: Clock | None = None,
) -> RunResult:
    """Connect, run every step, disconnect.

    A start that fails (bad strategy settings, unreachable broker, a locked run directory)
    removes the run directory if this call created it: a failed start leaves nothing behind.
    """
    run_dir = Path(cfg.run_dir)
    created = not run_dir.exists()
    try:
        coord = make_coordinator(
            cfg,
            transport,
            logger,
            health_check=health_check,
            signing=signing,
            revocations=revocations,
            observer=observer,
            clock=clock,
        )
    except BaseException:
        if created:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    try:
        try:
            coord.start()  # subscriptions first: queued messages of our session arrive on connect
            if not transport.connected:
                transport.connect()
        except BaseException:
            coord.store.close()
            if created:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        tracking = start_tracking(
            cfg.trackers, run_dir, cfg.run_id, cfg.to_dict(), cfg.tracking_uri
        )
        try:
            return coord.run()
        except QuorumError:
            raise  # the run gave up: recorded as failed, the fleet told it is finished
        except BaseException:
            # Ctrl-C, SIGTERM, a crash: resumable; the retained state must not say "running"
            # (a clean disconnect sends no will), or agents would wait for a coordinator gone
            coord.interrupted()
            raise
        finally:
            if tracking is not None:
                tracking.stop()  # the last records and the exported bundles
    finally:
        coord.store.close()
