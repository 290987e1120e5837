"""``coordinator ingest-worker``: take a run's replies off the broker for its coordinator."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.commands.options import (
    add_credential_options,
    add_log_options,
    coordinator_credentials,
)

if TYPE_CHECKING:
    from coordinator.commands.options import Subparsers

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> None:
    ing = sub.add_parser(
        "ingest-worker",
        help="take a run's replies off the broker for its coordinator (run.ingest_workers)",
    )
    ing.add_argument("--run-dir", required=True, help="the run directory of `coordinator serve`")
    ing.add_argument(
        "--broker",
        required=True,
        help="MQTT broker HOST[:PORT] or URL mqtt://, mqtts://, ws://, wss://HOST[:PORT][/PATH] "
        "(a real one)",
    )
    ing.add_argument("--id", default="w1", help="this worker's id, unique in the run")
    ing.add_argument(
        "--wait", type=float, default=60.0, help="seconds to wait for the run and the broker"
    )
    add_credential_options(ing)
    add_log_options(ing)


def run(args: argparse.Namespace) -> int:
    import logging

    from coordinator.engine.ingest_worker import run_ingest_worker
    from coordinator.engine.runner import SENDER
    from protocol.security.keys import load_signing
    from protocol.security.mode import connection_mode
    from protocol.transport.address import parse_broker

    creds = coordinator_credentials(args)
    signing = load_signing(creds, SENDER, enabled=not args.no_signing)
    broker = parse_broker(args.broker)
    mode = connection_mode(broker, creds, signing=signing is not None, insecure=args.insecure)
    mode.announce(logging.getLogger("edgefl"))
    counts = run_ingest_worker(
        Path(args.run_dir),
        worker=args.id,
        signing=signing,
        wait_s=args.wait,
        **broker.client_options(creds.transport_options()),
    )
    print(f"ingest worker {args.id}: {dict(sorted(counts.items()))}")
    return 0
