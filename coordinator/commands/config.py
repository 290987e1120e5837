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
    conf.add_argument(
        "--preset",
        default=None,
        metavar="NAME",
        help="also list every [hyper] value the preset NAME changes (run.preset = NAME), "
        "per algorithm: default -> preset",
    )
    conf.add_argument(
        "--algorithm",
        default=None,
        metavar="NAME",
        help="also list every [hyper] key of algorithm NAME: type, default, allowed range",
    )
    conf.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    import json

    from coordinator.config import hyper_keys, preset_differences, run_keys
    from protocol.errors import ConfigError

    keys = run_keys()
    changes = [] if args.preset is None else preset_differences(args.preset)
    if args.preset is not None and not changes:
        raise ConfigError(f"--preset {args.preset!r}: no algorithm has a preset of that name")
    hyper = [] if args.algorithm is None else hyper_keys(args.algorithm)
    if args.json:
        out: dict[str, object] = {
            "run": [dict(key=k, type=t, default=d, meaning=m) for k, t, d, m in keys]
        }
        if args.preset is not None:
            out["preset"] = [dict(algorithm=a, key=k, default=d, value=v) for a, k, d, v in changes]
        if args.algorithm is not None:
            out["hyper"] = [dict(key=k, type=t, default=d, range=r) for k, t, d, r in hyper]
        extra = args.preset is not None or args.algorithm is not None
        print(json.dumps(out if extra else out["run"], default=str))
        return 0
    print("[run] keys (TOML [run] section or --set run.KEY=VALUE):\n")
    kw, tw, dw = _widths(keys)
    for key, type_, default, meaning in keys:
        print(f"  {key:<{kw}} {type_:<{tw}} default {default!r:<{dw}} {meaning}")
    print(
        "\n[hyper] keys are the algorithm's (--algorithm NAME lists them); an unknown one is an "
        "error that lists them."
    )
    if hyper:
        print(f"\n[hyper] keys of {args.algorithm} (TOML [hyper] or --set hyper.KEY=VALUE):\n")
        kw, tw, dw = _widths(hyper)
        for key, type_, default, bounds in hyper:
            print(f"  {key:<{kw}} {type_:<{tw}} default {default!r:<{dw}} {bounds}".rstrip())
    if changes:
        print(f"\n[hyper] values run.preset = {args.preset!r} changes (default -> preset):\n")
        for algorithm, key, default, value in changes:
            print(f"  {algorithm:<10} {key:<20} {default!r} -> {value!r}")
    return 0


def _widths(rows: list[tuple[str, str, object, str]]) -> tuple[int, int, int]:
    """Column widths of name, type and default: the widest cell, up to a cap past which a
    rare long cell (an enumerated type, a long list) shifts its own row only."""

    def width(cells: list[str], cap: int) -> int:
        return min(max(map(len, cells)), cap)

    return (
        width([r[0] for r in rows], 28),
        width([r[1] for r in rows], 16),
        width([repr(r[2]) for r in rows], 16),
    )
