"""``coordinator``: serve a run, simulate a fleet, run the demo, render a report.

Each subcommand lives in :mod:`coordinator.commands`; no torch import happens before the
arguments are parsed, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import TYPE_CHECKING, Protocol

from coordinator.commands import (
    config,
    demo,
    ingest_worker,
    partition,
    provision,
    report,
    runs,
    serve,
    simulate,
)
from protocol.logs import setup_logging

if TYPE_CHECKING:
    from coordinator.commands.options import Subparsers

__all__ = ["build_parser", "main"]


class _Command(Protocol):
    """What a :mod:`coordinator.commands` module provides."""

    def add_parser(self, sub: Subparsers) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


# the subcommands in the order ``--help`` lists them, each with the module that runs it
_COMMANDS: dict[str, _Command] = {
    "serve": serve,
    "ingest-worker": ingest_worker,
    "provision": provision,
    "demo": demo,
    "simulate": simulate,
    "partition": partition,
    "status": runs,
    "runs": runs,
    "stop": runs,
    "config": config,
    "report": report,
}


def build_parser() -> argparse.ArgumentParser:
    """The ``coordinator`` argument parser."""
    p = argparse.ArgumentParser(
        prog="coordinator", description="Coordinate a model-heterogeneous federated run over MQTT."
    )
    sub = p.add_subparsers(dest="command", required=True)
    for module in dict.fromkeys(_COMMANDS.values()):  # runs adds status, runs and stop
        module.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``coordinator``."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging(getattr(args, "log_level", "INFO"), getattr(args, "log_format", "text"))
    from protocol.errors import EdgeFLError

    # SIGTERM (`coordinator stop`, systemd) ends a command as Ctrl-C does: cleanly
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return _COMMANDS[args.command].run(args)
    except EdgeFLError as exc:
        print(f"coordinator: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("coordinator: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
