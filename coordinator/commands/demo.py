"""``coordinator demo``: the whole system on this machine with bundled data."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from coordinator.commands.options import (
    add_run_options,
    add_split_options,
    run_config,
    split_fields,
)

if TYPE_CHECKING:
    from coordinator.commands.options import Subparsers
    from coordinator.config import RunConfig

__all__ = ["add_parser", "demo_config", "demo_feature_dim", "run"]


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


# The demo's defaults; --algorithm, --rounds, --data and --set override every value. The
# algorithm is the comparison table's pick (docs/results/common.md, "Overall": FedKTL, best on both
# metrics in both digits settings and the best personalised accuracy in both MNIST-5k ones, 20
# clients, 50 rounds, one training recipe). The demo's own setting is far smaller (4 agent
# processes, Dir 0.5, 8 rounds, local_epochs 2, lr 0.05), and there FedKTL shows no gain over
# local-only; mean accuracy over the agents on local / global test data, mean over seeds
# (`coordinator demo --algorithm A --seed S`):
#   mnist5k (28x28): fedktl 90.4% / 70.2% (feature size 10; seeds 0-2: 94.0/71.7, 86.1/67.9,
#                    91.1/71.0), local-only 93.1% / 71.7%, fedproto 94.2% / 72.8%,
#                    fedvtc 80.5% / 75.2% (the best global accuracy here; see below)
#   digits (8x8):    fedktl 95.8% / 63.9% (seeds 0-1: 95.7/64.0, 95.8/63.7), local-only
#                    94.9% / 64.9% (seeds 0-1: 94.0/64.0, 95.7/65.8; 93.9 / 67.4 over 0-2),
#                    fedproto 94.5% / 63.8%, fedvtc 75.1% / 59.1%
# fedvtc here carries the three deviations that make its generator work (docs/algorithms/fedvtc.md,
# "Combined deviations"; with the paper's settings it scores 22.1% / 14.0% on digits, seed 0).
# On mnist5k it gives every device the best accuracy on all classes (global, +3.5 points over
# local-only, no seed below it) and costs accuracy on the device's own skewed label mix (local,
# -12.6): its final fine-tuning on class-balanced synthetic data removes the local label prior.
DEMO_DEFAULTS = {"algorithm": "fedktl", "rounds": 8, "data": "mnist5k"}
# feature size per dataset: mnist5k uses the paper's MNIST generator (980 = 20x7x7 latent)
DEMO_FEATURE_DIM = {"digits": 64, "mnist5k": 980}
# ...except where the algorithm fixes it: FedKTL's ETF head needs K = C = 10
# (docs/algorithms/fedktl.md)
DEMO_ALGORITHM_FEATURE_DIM = {"fedktl": 10}
_DEMO_TRAINING = ["hyper.local_epochs=2", "hyper.lr=0.05"]
DEMO_HYPER = {
    "local": _DEMO_TRAINING,
    "fedavg": _DEMO_TRAINING,
    "fedproto": _DEMO_TRAINING,
    "fedktl": _DEMO_TRAINING,
    # the Felo family defaults to Adam 1e-3 (the authors' code); the demo keeps every algorithm
    # on the same SGD settings so its table compares the exchange, not the optimiser
    **{name: [*_DEMO_TRAINING, "hyper.optimizer=sgd"] for name in ("felo", "velo", "fedhe")},
    # FedVTC: the `fedvtc_combo` deviations (docs/algorithms/fedvtc.md) on top of the issue-17
    # defaults
    # (per-part clipping, psi in train mode in step A). Re-chosen from the fixed grid
    # (benchmarks/results/fedvtc_fixed.md, 3 seeds): final 62.8 / 71.5 at Dir 0.1 / 1.0 vs
    # 27.3 / 27.7 for the paper's settings with the same fixes and 27.7 / 53.5 for local-only
    "fedvtc": [
        *_DEMO_TRAINING,
        "hyper.synthetic_per_class=50",
        "hyper.model_tc_weight=0.1",
        "hyper.generator_bn_recalibrate=true",
        "hyper.sd_init=0.1",
        "hyper.sd_max=0.1",
    ],
}


def demo_config(args: argparse.Namespace) -> RunConfig:
    """The demo's defaults fill in only what the TOML, ``--set`` and the flags leave open."""
    from coordinator.config import read_layers

    given = read_layers(args.config, args.overrides, algorithm=args.algorithm, rounds=args.rounds)
    args.algorithm = given["run"].get("algorithm", DEMO_DEFAULTS["algorithm"])
    args.rounds = given["run"].get("rounds", DEMO_DEFAULTS["rounds"])
    args.overrides = DEMO_HYPER.get(str(args.algorithm), []) + list(args.overrides)
    args.data = args.data or DEMO_DEFAULTS["data"]
    return run_config(args, unused=("broker", "embedded_port", "embedded_host", "min_agents"))


def demo_feature_dim(algorithm: str, data: str, given: int | None) -> int:
    """The demo agents' feature size: ``--feature-dim``, else the algorithm's, else the
    dataset's."""
    return given or DEMO_ALGORITHM_FEATURE_DIM.get(algorithm) or DEMO_FEATURE_DIM.get(data, 64)


def run(args: argparse.Namespace) -> int:
    from coordinator.sim.demo import DemoSpec, run_demo

    cfg = demo_config(args)
    if args.partition_file is not None:  # a count mismatch fails before agents start
        from edge_agent.data import load_partition_file

        load_partition_file(args.partition_file, num_clients=args.agents)
    spec = DemoSpec(
        agents=args.agents,
        data=args.data,
        feature_dim=demo_feature_dim(cfg.algorithm, args.data, args.feature_dim),
        export=not args.no_export,
        **split_fields(args),
    )
    run_demo(cfg, spec)
    return 0
