"""``coordinator demo``: the whole system on this machine with bundled data."""

from __future__ import annotations

import argparse
import functools
import json
import logging
from typing import TYPE_CHECKING

from coordinator.commands.options import (
    add_run_options,
    add_split_options,
    run_config,
    split_fields,
)
from coordinator.presets import Preset, load_preset

if TYPE_CHECKING:
    from coordinator.commands.options import Subparsers
    from coordinator.config import RunConfig

__all__ = ["add_parser", "demo_config", "demo_feature_dim", "demo_overrides", "demo_preset", "run"]


def add_parser(sub: Subparsers) -> None:
    demo = sub.add_parser("demo", help="the whole system on this machine with bundled data")
    add_run_options(demo)
    demo.add_argument("--agents", type=int, default=4, help="number of edge-agent processes")
    demo.add_argument("--no-export", action="store_true", help="skip the ONNX export")
    demo.add_argument(
        "--data", default=None, help="bundled dataset: mnist5k (28x28, default) or digits (8x8)"
    )
    demo.add_argument(
        "--feature-dim", type=int, default=None, help="feature size (digits 64, mnist5k 980)"
    )
    add_split_options(demo, global_test_default=360)


@functools.cache
def demo_preset() -> Preset:
    """The demo's defaults (``coordinator/presets/demo.toml``; its comments say why); read on
    first use, not at import."""
    return load_preset("demo")


def demo_overrides(algorithm: str) -> list[str]:
    """The ``--set`` overrides the demo puts before the user's: the common training recipe
    under the algorithm's arm's ``hyper``; none for an algorithm without an arm."""
    preset = demo_preset()
    arm = preset.arms.get(algorithm)
    if arm is None:
        return []
    hyper = {**preset.other["common_train"], **arm.hyper}
    # JSON spells the scalars and arrays a preset holds as TOML literals (parse_override)
    return [f"hyper.{key}={json.dumps(value)}" for key, value in hyper.items()]


def demo_config(args: argparse.Namespace) -> RunConfig:
    """The demo's defaults fill in only what the TOML, ``--set`` and the flags leave open."""
    from coordinator.config import read_layers

    given = read_layers(args.config, args.overrides, algorithm=args.algorithm, rounds=args.rounds)
    defaults = demo_preset().settings
    args.algorithm = given["run"].get("algorithm", defaults["algorithm"])
    args.rounds = given["run"].get("rounds", defaults["rounds"])
    args.overrides = demo_overrides(str(args.algorithm)) + list(args.overrides)
    args.data = args.data or defaults["data"]
    cfg = run_config(args, unused=("broker", "embedded_port", "embedded_host", "min_agents"))
    return cfg if "generator" in given["hyper"] else _demo_generator(cfg)


def demo_feature_dim(cfg: RunConfig, data: str, given: int | None) -> int:
    """The demo agents' feature size: ``--feature-dim``, else the one the algorithm requires
    (:meth:`RunConfig.required_feature_dim`, FedKTL's ETF size), else the dataset's."""
    dataset_dims = demo_preset().other["feature_dim"]
    return given or cfg.required_feature_dim() or int(dataset_dims.get(data, 64))


def _demo_generator(cfg: RunConfig) -> RunConfig:
    """The run with the procedural generator where its default bundled one cannot load here
    (the demo must run from a plain ``pip install``; a generator the user chose is kept)."""
    from models.generators import bundled_unavailable

    generator = getattr(cfg.algorithm_config(), "generator", None)
    missing = None if generator is None else bundled_unavailable(str(generator))
    if missing is None:
        return cfg
    fallback = str(demo_preset().settings["fallback_generator"])
    logging.getLogger("edgefl.demo").warning(
        "%s; the demo uses the procedural %r generator instead (images of patterns, not faces)",
        missing,
        fallback,
    )
    return cfg.replace(hyper={**cfg.hyper, "generator": fallback})


def run(args: argparse.Namespace) -> int:
    from coordinator.sim.demo import DemoSpec, run_demo
    from protocol.security.mode import SecurityMode

    mode = SecurityMode(
        "in-process", "coordinator demo: broker, coordinator and agents on 127.0.0.1"
    )
    mode.announce(logging.getLogger("edgefl.demo"))
    cfg = demo_config(args)
    if args.partition_file is not None:  # a count mismatch fails before agents start
        from edge_agent.data import load_partition_file

        load_partition_file(args.partition_file, num_clients=args.agents)
    spec = DemoSpec(
        agents=args.agents,
        data=args.data,
        feature_dim=demo_feature_dim(cfg, args.data, args.feature_dim),
        export=not args.no_export,
        **split_fields(args),
    )
    run_demo(cfg, spec)
    return 0
