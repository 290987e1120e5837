"""``coordinator``: serve a run, simulate a fleet, run the demo, render a report.

No torch import happens before the arguments are parsed, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at run time: --help must stay instant
    from coordinator.config import RunConfig

__all__ = ["build_parser", "main"]


def _run_options(p: argparse.ArgumentParser, default_algorithm: str | None = None) -> None:
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
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")


def build_parser() -> argparse.ArgumentParser:
    """The ``coordinator`` argument parser."""
    p = argparse.ArgumentParser(
        prog="coordinator", description="Coordinate a model-heterogeneous federated run over MQTT."
    )
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the coordinator for a fleet of edge agents")
    _run_options(serve)
    serve.add_argument("--broker", default=None, help="MQTT broker HOST[:PORT]; none = embedded")
    serve.add_argument("--port", type=int, default=None, help="embedded broker port (default 1883)")
    serve.add_argument("--min-agents", type=int, default=None, help="agents needed to start")
    demo = sub.add_parser("demo", help="the whole system on this machine with bundled data")
    _run_options(demo)
    demo.add_argument("--agents", type=int, default=4, help="number of edge-agent processes")
    demo.add_argument("--no-export", action="store_true", help="skip the ONNX export")
    demo.add_argument(
        "--data", default=None, help="bundled dataset: mnist5k (28x28, default) or digits (8x8)"
    )
    demo.add_argument(
        "--feature-dim", type=int, default=None, help="feature size (digits 64, mnist5k 980)"
    )
    sim = sub.add_parser("simulate", help="many agents in one process (in-memory transport)")
    _run_options(sim)
    sim.add_argument("--agents", type=int, default=10, help="simulated devices")
    sim.add_argument("--family", default="tiny", help="model family assigned round-robin")
    sim.add_argument(
        "--models", default=None, help="comma-separated architectures (overrides --family)"
    )
    sim.add_argument("--data", default="digits", help="dataset")
    sim.add_argument(
        "--partition", default="dirichlet:0.5", help="iid | dirichlet:A | pathological:K"
    )
    sim.add_argument("--feature-dim", type=int, default=64, help="shared feature size (0 = native)")
    sim.add_argument("--image-size", type=int, default=None, help="resize images")
    sim.add_argument("--export", action="store_true", help="export ONNX bundles at the end")
    rep = sub.add_parser("report", help="markdown table and PNG plot of a run directory")
    rep.add_argument("run_dir", type=Path)
    rep.add_argument(
        "--png", type=Path, default=None, help="plot path (default RUN_DIR/report.png)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``coordinator``."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from protocol.errors import EdgeFLError

    try:
        return _COMMANDS[args.command](args)
    except EdgeFLError as exc:
        print(f"coordinator: error: {exc}", file=sys.stderr)
        return 2


def _config(args: argparse.Namespace, **extra: object) -> RunConfig:
    from coordinator.config import load_config

    run_dir = args.run_dir or f"runs/{args.command}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = load_config(
        args.config,
        args.overrides,
        algorithm=args.algorithm,
        rounds=args.rounds,
        run_dir=run_dir,
        seed=args.seed,
        **extra,
    )
    if cfg.run_id == "run":  # not chosen: name the run after its directory (reports, plots)
        cfg = dataclasses.replace(cfg, run_id=Path(cfg.run_dir).name)
    return cfg


def _serve(args: argparse.Namespace) -> int:
    from coordinator.runner import coordinator_will, run_coordinator
    from protocol.mqtt import MqttTransport, parse_broker

    cfg = _config(args, broker=args.broker, min_agents=args.min_agents, embedded_port=args.port)
    if cfg.broker:
        host, port = parse_broker(cfg.broker)
        transport = MqttTransport(
            host=host, port=port, client_id="edgefl-coordinator", will=coordinator_will(cfg)
        )
        run_coordinator(cfg, transport)
        return 0
    from protocol.broker import EmbeddedBroker

    with EmbeddedBroker(host="0.0.0.0", port=cfg.embedded_port) as broker:
        logging.getLogger("edgefl").info("embedded MQTT broker listening on port %d", broker.port)
        transport = MqttTransport(
            host="127.0.0.1",
            port=broker.port,
            client_id="edgefl-coordinator",
            will=coordinator_will(cfg),
        )
        try:
            run_coordinator(cfg, transport)
        finally:
            transport.close()
    return 0


# The demo's defaults, sized to finish in about a minute and a half on 2 CPU cores;
# --algorithm, --rounds, --data and --set override every value. Measured with these settings
# (4 agent processes, Dir 0.5, 8 rounds, local_epochs 2, lr 0.05), mean accuracy over the agents
# on local / global test data, mean over seeds 0-2 (`coordinator demo --algorithm A --seed S`):
#   mnist5k (28x28): fedvtc 80.5% / 75.2%, fedproto 94.2% / 72.8%, local-only 93.1% / 71.7%
#   digits (8x8):    fedvtc 75.1% / 59.1%, fedproto 94.5% / 63.8%, local-only 93.9% / 67.4%
# fedvtc here carries the three deviations that make its generator work (docs/fedvtc.md,
# "Combined deviations"; with the paper's settings it scores 22.1% / 14.0% on digits, seed 0).
# On mnist5k it gives every device the best accuracy on all classes (global, +3.5 points over
# local-only, no seed below it) and costs accuracy on the device's own skewed label mix (local,
# -12.6): its final fine-tuning on class-balanced synthetic data removes the local label prior.
DEMO_DEFAULTS = {"algorithm": "fedvtc", "rounds": 8, "data": "mnist5k"}
# feature size per dataset: mnist5k uses the paper's MNIST generator (980 = 20x7x7 latent)
DEMO_FEATURE_DIM = {"digits": 64, "mnist5k": 980}
_DEMO_TRAINING = ["hyper.local_epochs=2", "hyper.lr=0.05"]
DEMO_HYPER = {
    "local": _DEMO_TRAINING,
    "fedavg": _DEMO_TRAINING,
    "fedproto": _DEMO_TRAINING,
    # the Felo family defaults to Adam 1e-3 (the authors' code); the demo keeps every algorithm
    # on the same SGD settings so its table compares the exchange, not the optimiser
    **{name: [*_DEMO_TRAINING, "hyper.optimizer=sgd"] for name in ("felo", "velo", "fedhe")},
    "fedvtc": [
        *_DEMO_TRAINING,
        "hyper.synthetic_per_class=50",
        "hyper.model_tc_weight=0.1",
        "hyper.generator_bn_recalibrate=true",
        "hyper.sd_init=0.1",
        "hyper.sd_max=0.1",
    ],
}


def _demo(args: argparse.Namespace) -> int:
    from coordinator.demo import DemoSpec, run_demo

    args.algorithm = args.algorithm or DEMO_DEFAULTS["algorithm"]
    args.rounds = args.rounds if args.rounds is not None else DEMO_DEFAULTS["rounds"]
    args.overrides = DEMO_HYPER.get(args.algorithm, []) + list(args.overrides)
    args.data = args.data or DEMO_DEFAULTS["data"]
    cfg = _config(args)
    feature_dim = args.feature_dim or DEMO_FEATURE_DIM.get(args.data, 64)
    spec = DemoSpec(
        agents=args.agents, data=args.data, feature_dim=feature_dim, export=not args.no_export
    )
    run_demo(cfg, spec)
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from coordinator.simulate import FleetSpec, simulate
    from models.families import family_models

    cfg = _config(args, min_agents=args.agents)
    models = (
        tuple(args.models.split(","))
        if args.models
        else tuple(family_models(args.family, args.agents))
    )
    fleet = FleetSpec(
        num_agents=args.agents,
        models=models,
        data=args.data,
        partition=args.partition,
        feature_dim=args.feature_dim or None,
        image_size=args.image_size,
        export=args.export,
    )
    from coordinator.demo import summarize

    result = simulate(cfg, fleet)
    print(summarize(result, Path(cfg.run_dir)))
    return 0


def _report(args: argparse.Namespace) -> int:
    from coordinator.report import plot_report, render_report

    print(render_report(args.run_dir))
    png = args.png or args.run_dir / "report.png"
    plot_report(args.run_dir, png)
    print(f"\nplot: {png}")
    return 0


_COMMANDS = {"serve": _serve, "demo": _demo, "simulate": _simulate, "report": _report}

if __name__ == "__main__":
    sys.exit(main())
