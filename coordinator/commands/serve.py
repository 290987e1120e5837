"""``coordinator serve``: run the coordinator for a fleet of edge agents."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator.commands.options import (
    add_credential_options,
    add_run_options,
    coordinator_credentials,
    resolve_run,
)

if TYPE_CHECKING:  # torch-free at run time: --help must stay instant
    from coordinator.broker.embedded import EmbeddedBroker
    from coordinator.commands.options import Subparsers
    from coordinator.config import RunConfig
    from coordinator.engine.core import RunResult
    from coordinator.engine.observer import RunObserver
    from coordinator.tracking.prometheus import MetricsServer
    from protocol.security.credentials import Credentials
    from protocol.security.mode import SecurityMode
    from protocol.transport.address import BrokerAddress

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> None:
    serve = sub.add_parser("serve", help="run the coordinator for a fleet of edge agents")
    add_run_options(serve)
    serve.add_argument(
        "--broker",
        default=None,
        help="MQTT broker HOST[:PORT] or URL mqtt://, mqtts://, ws://, wss://HOST[:PORT][/PATH]; "
        "none = embedded",
    )
    serve.add_argument("--port", type=int, default=None, help="embedded broker port (default 1883)")
    serve.add_argument(
        "--ws-port",
        type=int,
        default=None,
        help="the embedded broker also serves MQTT over WebSockets on this port (agents: "
        "--broker ws://HOST:PORT; with --broker-dir WebSockets over the fleet's mutual TLS, "
        "wss://, by default on the broker directory's websockets listener if it has one)",
    )
    serve.add_argument(
        "--listen",
        default=None,
        help="embedded broker interface (default 127.0.0.1; 0.0.0.0 exposes an unauthenticated "
        "broker unless --broker-dir gives it the fleet's mutual TLS and ACL)",
    )
    serve.add_argument(
        "--broker-dir",
        type=Path,
        default=None,
        help="run the embedded broker with the provisioned OUT/broker directory (mutual TLS, "
        "the fleet's ACL and CRL) and connect to it with --kit OUT/coordinator",
    )
    serve.add_argument("--min-agents", type=int, default=None, help="agents needed to start")
    serve.add_argument(
        "--spawn-workers",
        action="store_true",
        help="start the run.ingest_workers `coordinator ingest-worker` processes here (logs in "
        "RUN_DIR/ingest/), with this command's credentials; they end with the run",
    )
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics of the run on http://HOST:PORT/metrics (needs "
        "pip install edgefl[metrics]); default: none",
    )
    serve.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="interface of --metrics-port (default 127.0.0.1; the metrics name every agent)",
    )
    add_credential_options(serve)


def run(args: argparse.Namespace) -> int:
    from coordinator.engine.core import RunResult
    from coordinator.engine.runner import SENDER
    from coordinator.sim.demo import describe_algorithm, summarize
    from protocol.security.keys import load_signing

    creds = coordinator_credentials(args)
    cfg, info = resolve_run(
        args,
        **{
            "broker": args.broker,
            "min_agents": args.min_agents,
            "embedded_port": args.port,
            "embedded_host": args.listen,
            **_kit_run_keys(args, creds),
        },
    )
    spawn = _worker_options(args, cfg) if args.spawn_workers else None
    # on whenever the kit (or --credentials, EDGEFL_*) has signing keys
    signing = load_signing(creds, SENDER, enabled=not args.no_signing)
    _security_mode(args, cfg, creds, signing is not None).announce(logging.getLogger("edgefl"))
    if info is not None and info.outcome == "finished":
        from coordinator.store.database import Store

        print(f"run {cfg.run_dir} is finished ({info.steps_done} steps); nothing to do")
        store = Store(Path(cfg.run_dir) / "state.sqlite")
        result = RunResult(cfg.run_id, info.steps_done, store.metrics(), {})
        store.close()
        print(summarize(result, Path(cfg.run_dir), cfg))
        return 0
    metrics = _metrics_server(args)
    try:
        verb = "resuming" if info is not None else "run directory"
        print(f"{verb}: {cfg.run_dir}\n{describe_algorithm(cfg)}", flush=True)
        observer = None if metrics is None else metrics.exporter
        result = _serve_run(
            cfg,
            creds,
            signing,
            _fleet_broker(args),
            spawn=spawn,
            ws_port=args.ws_port,
            observer=observer,
        )
    except KeyboardInterrupt:
        _interrupted(args, cfg)
        return 130
    finally:
        if metrics is not None:
            metrics.close()
    print(summarize(result, Path(cfg.run_dir), cfg))
    return 0


def _metrics_server(args: argparse.Namespace) -> MetricsServer | None:
    """``--metrics-port``: the Prometheus exporter, serving (its library imported only now)."""
    if args.metrics_port is None:
        return None
    from protocol.errors import ConfigError

    try:
        from coordinator.tracking.prometheus import MetricsServer
    except ImportError as exc:
        if exc.name != "prometheus_client":
            raise
        raise ConfigError(
            "--metrics-port needs the prometheus_client library: pip install edgefl[metrics]"
        ) from exc
    server = MetricsServer(args.metrics_host, args.metrics_port)
    logging.getLogger("edgefl").info(
        "Prometheus metrics on http://%s:%d/metrics", server.host, server.port
    )
    return server


def _interrupted(args: argparse.Namespace, cfg: RunConfig) -> None:
    from coordinator.ops.lifecycle import read_run

    if read_run(cfg.run_dir) is None:  # stopped before the run started: nothing was kept
        print("\ncoordinator: stopped before the run started", file=sys.stderr)
        return
    print(
        f"\ncoordinator: stopped; the run's state is saved in {cfg.run_dir}. Resume with:\n"
        f"  coordinator {_resume_command(args.argv, cfg.run_dir)}",
        file=sys.stderr,
    )


def _resume_command(argv: list[str], run_dir: str) -> str:
    """The command line that resumes this run: the same one, with its run directory."""
    import shlex

    if "--run-dir" not in argv and not any(a.startswith("--run-dir=") for a in argv):
        argv = [*argv, "--run-dir", run_dir]
    return " ".join(shlex.quote(a) for a in argv)


def _kit_run_keys(args: argparse.Namespace, creds: Credentials) -> dict[str, object]:
    """``broker`` and ``federation`` from the kit where the config and flags give none."""
    from coordinator.config import read_layers
    from protocol.errors import ConfigError

    if creds.kit is None:
        return {}
    given = read_layers(args.config, args.overrides, broker=args.broker)["run"]
    out: dict[str, object] = {}
    if not given.get("broker"):
        out["broker"] = creds.kit.broker
    if "federation" not in given:
        out["federation"] = creds.kit.federation
    elif given["federation"] != creds.kit.federation:
        raise ConfigError(
            f"run.federation is {given['federation']!r} but the kit {creds.kit.path} is for "
            f"federation {creds.kit.federation!r} (its ACL allows no other)"
        )
    return out


def _security_mode(
    args: argparse.Namespace, cfg: RunConfig, creds: Credentials, signing: bool
) -> SecurityMode:
    """The run's security mode (:mod:`protocol.security.mode`): a broker given (``--broker``,
    the kit's), or the embedded one, which authenticates nobody unless ``--broker-dir`` gives
    it the fleet's rules (then the kit names it as the broker)."""
    from protocol.errors import ConfigError
    from protocol.security.mode import SecurityMode, connection_mode, is_loopback
    from protocol.transport.address import parse_broker

    if cfg.broker:
        broker = parse_broker(cfg.broker)
        return connection_mode(broker, creds, signing=signing, insecure=args.insecure)
    host = cfg.embedded_host
    if is_loopback(host):
        return SecurityMode(
            "loopback", f"embedded broker on {host}, reachable from this machine only"
        )
    if args.insecure:
        return SecurityMode(
            "insecure",
            f"--insecure: embedded broker on {host} without authentication; anyone who "
            "reaches it can read and forge every message",
        )
    raise ConfigError(
        f"refusing to run the embedded broker on {host} without authentication: keep it on "
        "127.0.0.1 (no --listen), give it the fleet's mutual TLS (--broker-dir OUT/broker "
        "--kit OUT/coordinator), connect to a secured broker (--broker HOST with --kit DIR or "
        "--credentials FILE), or --insecure to run it unauthenticated anyway"
    )


def _fleet_broker(args: argparse.Namespace) -> EmbeddedBroker | None:
    """``--broker-dir``: the embedded broker on a provisioned broker directory, listening where
    its ``mosquitto.conf`` says unless ``--listen`` / ``--port`` say otherwise."""
    if args.broker_dir is None:
        return None
    from coordinator.broker.embedded import BrokerFiles, EmbeddedBroker

    files = BrokerFiles.open(args.broker_dir)
    port, host = files.listener()
    host = args.listen if args.listen is not None else host
    ws_port = args.ws_port if args.ws_port is not None else files.websocket_port()
    return EmbeddedBroker(host=host, port=args.port or port, fleet=files, ws_port=ws_port)


def _serve_run(
    cfg: RunConfig,
    creds: Credentials,
    signing: Any,
    fleet_broker: EmbeddedBroker | None = None,
    *,
    spawn: list[str] | None = None,
    ws_port: int | None = None,
    observer: RunObserver | None = None,
) -> RunResult:
    """The run over ``cfg.broker; over the embedded broker when there is none; over the
    embedded broker enforcing a provisioned fleet's rules with ``fleet_broker``. ``signing``:
    the coordinator's keys (``None``: frames unsigned); ``ws_port``: the embedded broker also
    serves MQTT over WebSockets there; ``observer``: told of the run's events (the metrics
    exporter)."""
    from coordinator.broker.embedded import EmbeddedBroker
    from protocol.errors import ConfigError
    from protocol.transport.address import BrokerAddress, parse_broker

    if cfg.ingest_workers and (fleet_broker is not None or not cfg.broker):
        raise ConfigError(
            f"run.ingest_workers = {cfg.ingest_workers}: the workers take the replies through an "
            "MQTT shared subscription ($share/...), which the embedded broker (amqtt) does not "
            "support: they would receive none. Give --broker HOST of a Mosquitto 2, EMQX or "
            "HiveMQ broker, or set run.ingest_workers=0"
        )
    if ws_port is not None and fleet_broker is None and cfg.broker:
        raise ConfigError(
            f"--ws-port {ws_port} is a listener of the embedded broker, but the run uses the "
            f"broker at {cfg.broker}: give that broker a WebSockets listener (`coordinator "
            "provision --ws-port`) and connect with --broker ws:// or wss://"
        )
    if fleet_broker is not None:
        if creds.kit is None or not cfg.broker:
            raise ConfigError(
                "--broker-dir runs the fleet's broker here and needs the coordinator's kit "
                "(--kit OUT/coordinator) to connect to it"
            )
        with fleet_broker:
            return _run_over(
                cfg, parse_broker(cfg.broker), creds, signing, spawn=spawn, observer=observer
            )
    if cfg.broker:
        return _run_over(
            cfg, parse_broker(cfg.broker), creds, signing, spawn=spawn, observer=observer
        )
    if creds.tls or creds.password:
        raise ConfigError(
            f"broker credentials given ({creds.describe()}) but no broker: the embedded broker "
            "authenticates only a provisioned fleet; give --broker, a kit, or --broker-dir "
            "OUT/broker with the coordinator's kit"
        )
    embedded = EmbeddedBroker(host=cfg.embedded_host, port=cfg.embedded_port, ws_port=ws_port)
    with embedded as broker:
        logging.getLogger("edgefl").info("embedded MQTT broker listening on port %d", broker.port)
        local = BrokerAddress("127.0.0.1", broker.port)
        return _run_over(cfg, local, None, signing, spawn=spawn, observer=observer)


def _run_over(
    cfg: RunConfig,
    broker: BrokerAddress,
    creds: Credentials | None,
    signing: Any,
    *,
    spawn: list[str] | None = None,
    observer: RunObserver | None = None,
) -> RunResult:
    """The run over ``broker``; with ``spawn`` (the workers' credential options), its ingest
    workers started here for the run's duration; ``observer`` as in :func:`_serve_run`."""
    from contextlib import AbstractContextManager, nullcontext

    from coordinator.engine.ingest_worker import spawned_workers
    from coordinator.engine.runner import mqtt_transport, run_coordinator
    from coordinator.ops.revocation import kit_revocations

    options = broker.client_options(creds.transport_options() if creds is not None else {})
    transport = mqtt_transport(cfg, **options)
    workers: AbstractContextManager[object] = (
        spawned_workers(cfg, broker, spawn) if spawn is not None else nullcontext()
    )
    try:
        with workers:
            revocations = kit_revocations(creds.kit if creds is not None else None)
            return run_coordinator(
                cfg, transport, signing=signing, revocations=revocations, observer=observer
            )
    finally:
        transport.close()  # a clean disconnect: the retained state stays "finished"


def _worker_options(args: argparse.Namespace, cfg: RunConfig) -> list[str]:
    """``serve --spawn-workers``: the credential flags the workers need, as serve got them."""
    from protocol.errors import ConfigError

    if cfg.ingest_workers < 1:
        raise ConfigError(
            "--spawn-workers starts run.ingest_workers processes, but run.ingest_workers is 0 "
            "(set it, e.g. --set run.ingest_workers=2)"
        )
    options = [] if args.kit is None else ["--kit", str(args.kit)]
    options += [] if args.credentials is None else ["--credentials", str(args.credentials)]
    options += ["--insecure"] if args.insecure else []
    return options + (["--no-signing"] if args.no_signing else [])
