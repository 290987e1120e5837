"""``coordinator config``: the run configuration keys."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.commands.options import Subparsers

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> None:
    conf = sub.add_parser("config", help="the run configuration keys")
    conf.add_argument(
        "--defaults", action="store_true", help="every [run] key: type, default, meaning"
    )
    conf.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    import json

    from coordinator.config import run_keys

    keys = run_keys()
    if args.json:
        print(json.dumps([dict(key=k, type=t, default=d, meaning=m) for k, t, d, m in keys]))
        return 0
    print("[run] keys (TOML [run] section or --set run.KEY=VALUE):\n")
    for key, type_, default, meaning in keys:
        print(f"  {key:<16} {type_:<6} default {default!r:<12} {meaning}")
    print("\n[hyper] keys are the algorithm's; an unknown one is an error that lists them.")
    return 0
