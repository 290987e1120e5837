"""Option groups that several subcommands share, and what they resolve to."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch-free at run time: --help must stay instant
    from coordinator.config import RunConfig
    from coordinator.ops.lifecycle import RunInfo
    from protocol.security.credentials import Credentials

    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

__all__ = [
    "add_credential_options",
    "add_log_options",
    "add_run_options",
    "add_split_options",
    "coordinator_credentials",
    "resolve_run",
    "run_config",
    "split_fields",
]


def add_run_options(p: argparse.ArgumentParser, default_algorithm: str | None = None) -> None:
    p.add_argument("--config", type=Path, default=None, help="run config TOML ([run], [hyper])")
    p.add_argument(
        "--set",
        dest="overrides",
        action="extend",
        nargs="+",
        default=[],
        metavar="SECTION.KEY=V",
        help="override config values, e.g. --set run.rounds=5 hyper.lr=0.05 (repeatable)",
    )
    p.add_argument("--algorithm", default=default_algorithm, help="algorithm name")
    p.add_argument("--rounds", type=int, default=None, help="training rounds")
    p.add_argument("--run-dir", default=None, help="where state, metrics and exports go")
    p.add_argument("--seed", type=int, default=None, help="run seed")
    add_log_options(p)


def add_log_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    p.add_argument(
        "--log-format", choices=("text", "json"), default="text", help="json: one object a line"
    )


def add_split_options(p: argparse.ArgumentParser, global_test_default: int) -> None:
    """How the simulated agents split the data (a reproduction's knobs)."""
    p.add_argument(
        "--partition-file",
        type=Path,
        default=None,
        help="the agents' split from a file: train_idx_K / test_idx_K (and optional "
        "global_test_idx) index arrays over --data; replaces --partition and the split knobs",
    )
    p.add_argument(
        "--partition-seed", type=int, default=None, help="seed of the split (default: --seed)"
    )
    p.add_argument(
        "--test-fraction", type=float, default=0.2, help="each client's local test share"
    )
    p.add_argument("--min-size", type=int, default=10, help="fewest samples a client may get")
    p.add_argument(
        "--global-test-size",
        type=int,
        default=global_test_default,
        help="held-out global test set (0 = none)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=1,
        metavar="N",
        help="agents evaluate every N-th training round (and always at the end)",
    )
    p.add_argument(
        "--global-eval-every",
        type=int,
        default=1,
        metavar="N",
        help="agents score the global test set only every N-th training round (and always at "
        "the end): it is often many times a client's own test split",
    )


def add_credential_options(p: argparse.ArgumentParser) -> None:
    from protocol.security.flags import add_arguments

    add_arguments(p)


def run_config(
    args: argparse.Namespace,
    unused: tuple[str, ...] = (),
    defaults: dict[str, object] | None = None,
    **extra: object,
) -> RunConfig:
    return resolve_run(args, unused, defaults, **extra)[0]


def resolve_run(
    args: argparse.Namespace,
    unused: tuple[str, ...] = (),
    defaults: dict[str, object] | None = None,
    **extra: object,
) -> tuple[RunConfig, RunInfo | None]:
    """The run's config, and what its run directory already holds (``None``: a new run).

    ``run_dir`` may come from the TOML, ``--set run.run_dir=`` or ``--run-dir`` (that order of
    precedence); only when none gives it is a fresh ``runs/COMMAND-TIMESTAMP`` chosen. Keys in
    ``unused`` are decided by the command itself: giving one is an error, not silently ignored.
    ``defaults``: the command's own defaults of run keys, which the TOML and ``--set`` override;
    ``extra``: values the command decides (they override both).
    """
    from coordinator.config import read_layers
    from coordinator.ops.lifecycle import resolve_config
    from protocol.errors import ConfigError

    data = read_layers(
        args.config,
        args.overrides,
        algorithm=args.algorithm,
        rounds=args.rounds,
        run_dir=args.run_dir,
        seed=args.seed,
    )
    given = sorted(k for k in unused if k in data["run"])
    if given:
        raise ConfigError(
            f"run.{given[0]} has no effect in `coordinator {args.command}` "
            f"(it sets {', '.join(unused)} itself); remove it"
        )
    for key, value in (defaults or {}).items():
        data["run"].setdefault(key, value)
    data["run"].update({k: v for k, v in extra.items() if v is not None})
    data["run"].setdefault("run_dir", f"runs/{args.command}-{time.strftime('%Y%m%d-%H%M%S')}")
    cfg, info = resolve_config(data)
    if info is None and "run_id" not in data["run"]:
        # not chosen: name the run after its directory (reports, plots, client id)
        cfg = cfg.replace(run_id=Path(cfg.run_dir).name)
    return cfg, info


def split_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The split knobs shared by ``FleetSpec`` and ``DemoSpec``."""
    return {
        "partition_file": None if args.partition_file is None else str(args.partition_file),
        "partition_seed": args.partition_seed,
        "test_fraction": args.test_fraction,
        "min_size": args.min_size,
        "global_test_size": args.global_test_size,
        "eval_every": args.eval_every,
        "global_eval_every": args.global_eval_every,
    }


def coordinator_credentials(args: argparse.Namespace) -> Credentials:
    """Broker credentials from --kit/--credentials/EDGEFL_* (never stored with the run)."""
    from protocol.errors import ConfigError
    from protocol.security.credentials import load_credentials

    creds = load_credentials(kit=args.kit, credentials_file=args.credentials)
    if creds.kit is not None and creds.kit.role != "coordinator":
        raise ConfigError(
            f"kit {creds.kit.path} is device {creds.kit.id!r}'s; `coordinator serve` needs the "
            "coordinator's kit (OUT/coordinator of `coordinator provision`)"
        )
    logging.getLogger("edgefl").info("broker credentials: %s", creds.describe())
    return creds
