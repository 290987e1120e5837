"""``coordinator simulate``: many agents in one process (in-memory transport) or in Ray
actors."""

from __future__ import annotations

import argparse
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator.commands.options import (
    add_run_options,
    add_split_options,
    run_config,
    split_fields,
)
from protocol.algorithms.base import DEFAULT_FEATURE_DIM
from protocol.cli_args import non_negative_int

if TYPE_CHECKING:
    from coordinator.commands.options import Subparsers
    from coordinator.config import RunConfig
    from protocol.security.mode import SecurityMode

__all__ = ["add_parser", "run", "simulate_feature_dim", "simulated_deadline"]


def add_parser(sub: Subparsers) -> None:
    sim = sub.add_parser(
        "simulate", help="many agents in one process (in-memory transport) or in Ray actors"
    )
    add_run_options(sim)
    sim.add_argument("--agents", type=int, default=10, help="simulated devices")
    sim.add_argument(
        "--family",
        default=None,
        help="model family assigned round-robin (default: tiny; homo_mlp for an algorithm that "
        "averages whole models)",
    )
    sim.add_argument(
        "--models", default=None, help="comma-separated architectures (overrides --family)"
    )
    sim.add_argument("--data", default="digits", help="dataset")
    sim.add_argument(
        "--partition", default="dirichlet:0.5", help="iid | dirichlet:A | pathological:K"
    )
    sim.add_argument(
        "--feature-dim",
        type=int,
        default=None,
        help="shared feature size (0 = native; default: the algorithm's, else "
        f"{DEFAULT_FEATURE_DIM})",
    )
    sim.add_argument(
        "--feature-act", choices=["none", "relu"], default="none", help="activation after it"
    )
    sim.add_argument("--image-size", type=int, default=None, help="resize images")
    sim.add_argument("--export", action="store_true", help="export ONNX bundles at the end")
    add_split_options(sim, global_test_default=360)
    sim.add_argument(
        "--threads",
        type=non_negative_int,
        default=0,
        help="CPU threads (torch's pool and NumPy's BLAS) of the process, of each actor with "
        "--backend ray (0 = torch's default; BLAS then gets 1, as the agents call it at once)",
    )
    sim.add_argument(
        "--device", default="cpu", help="where the agents train: cpu, cuda[:N] or auto"
    )
    sim.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="FILE",
        help="device profiles (TOML): slower devices, link latency and bandwidth, dropout "
        "(docs/howto/simulate-a-fleet.md)",
    )
    sim.add_argument(
        "--clock",
        choices=("real", "simulated"),
        default="real",
        help="real: a profile's delays are waited out; simulated: they are scheduled on a "
        "simulated clock that jumps from one reply to the next (deadlines and the metrics' "
        "times on it; in-process backend only)",
    )
    _add_ray_options(sim)


def _add_ray_options(p: argparse.ArgumentParser) -> None:
    """``simulate --backend ray``: the agents in Ray actors over MQTT."""
    p.add_argument(
        "--backend",
        choices=("inprocess", "ray"),
        default="inprocess",
        help="inprocess: threads of this process; ray: Ray actors over MQTT (edgefl[ray])",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster to join (ray.init address, e.g. auto); default: a local instance",
    )
    p.add_argument(
        "--agents-per-actor",
        type=int,
        default=None,
        metavar="K",
        help="agents (threads) in each Ray actor (default: the fewest that fit the cluster)",
    )
    p.add_argument("--actor-cpus", type=float, default=None, help="Ray CPUs per actor (1)")
    p.add_argument("--actor-gpus", type=float, default=None, help="Ray GPUs per actor (0)")
    p.add_argument(
        "--broker",
        default=None,
        metavar="HOST[:PORT]",
        help="MQTT broker every Ray node reaches (default: Mosquitto or the embedded broker "
        "started on 127.0.0.1, enough for a local instance)",
    )


def _family(args: argparse.Namespace, algorithm: str) -> str:
    """``--family``, else the one the algorithm can run (said in the log when it is not the
    usual heterogeneous one)."""
    from coordinator.sim.simulate import DEFAULT_FAMILY, default_family

    if args.family is not None:
        return str(args.family)
    family = default_family(algorithm)
    if family != DEFAULT_FAMILY:
        logging.getLogger("edgefl.simulate").info(
            "%s averages whole models: the fleet runs the one-architecture family %s "
            "(--family or --models to choose another)",
            algorithm,
            family,
        )
    return family


def simulate_feature_dim(cfg: RunConfig, given: int | None) -> int | None:
    """The simulated agents' feature size: ``--feature-dim`` (0: native, ``None``), else the
    one the algorithm requires (the size a real agent adopts from the run), else the default."""
    if given is not None:
        return given or None
    return cfg.required_feature_dim() or DEFAULT_FEATURE_DIM


def simulated_deadline(agents: int, cores: int | None = None) -> float:
    """A step's default deadline when ``agents`` train at once on this host's ``cores``: the
    run default (the time one device may take) times the agents sharing each core, since a
    simulated step's wall time grows with them (FedType's ResNet-18 proxy takes ~90-140 s a
    round for each of 3 agents on 2 cores, past the 120 s a device gets)."""
    from coordinator.config import RunConfig

    per_core = math.ceil(agents / max(1, cores or os.cpu_count() or 1))
    return RunConfig.deadline_s * max(1, per_core)


def run(args: argparse.Namespace) -> int:
    from coordinator.sim.simulate import FleetSpec, simulate
    from models.families import family_models

    ray = _ray_spec(args)  # misplaced Ray flags fail before anything starts
    _security_mode(args).announce(logging.getLogger("edgefl"))
    cfg = run_config(
        args,
        unused=("broker", "embedded_port", "embedded_host", "min_agents"),
        defaults={"deadline_s": simulated_deadline(args.agents)},
        min_agents=args.agents,
    )
    models = (
        tuple(args.models.split(","))
        if args.models
        else tuple(family_models(_family(args, cfg.algorithm), args.agents))
    )
    from coordinator.sim.profile import load_profile

    fleet = FleetSpec(
        num_agents=args.agents,
        models=models,
        data=args.data,
        partition=args.partition,
        feature_dim=simulate_feature_dim(cfg, args.feature_dim),
        feature_act=None if args.feature_act == "none" else args.feature_act,
        image_size=args.image_size,
        export=args.export,
        device=args.device,
        profile=None if args.profile is None else load_profile(args.profile),
        **split_fields(args),
    )
    from coordinator.sim.demo import summarize
    from models.cpu_threads import apply_thread_setting

    # with --backend ray this process runs the coordinator alone
    apply_thread_setting(args.threads, agents=args.agents if args.backend == "inprocess" else 1)

    clock = None
    if args.clock == "simulated":
        from coordinator.sim.clock import SimulatedClock

        clock = SimulatedClock()
    result = simulate(cfg, fleet, backend=args.backend, ray=ray, clock=clock)
    print(summarize(result, Path(cfg.run_dir), cfg))
    return 0


def _security_mode(args: argparse.Namespace) -> SecurityMode:
    """A simulation is no deployment: its agents run here (or in Ray actors the run starts),
    so no broker connection is refused; the line says where the messages go."""
    from protocol.security.mode import SecurityMode

    if args.backend != "ray":
        return SecurityMode("in-process", "coordinator simulate: agents in this process")
    where = args.broker or "a broker started on 127.0.0.1"
    return SecurityMode("in-process", f"coordinator simulate: Ray actors over {where}")


_RAY_FLAGS = ("ray_address", "agents_per_actor", "actor_cpus", "actor_gpus", "broker")


def _ray_spec(args: argparse.Namespace) -> Any:
    """The :class:`~coordinator.sim.ray_backend.RayOptions` of ``--backend ray`` (else None)."""
    from protocol.errors import ConfigError

    given = [f"--{k.replace('_', '-')}" for k in _RAY_FLAGS if getattr(args, k) is not None]
    if args.backend != "ray":
        if given:
            raise ConfigError(f"{', '.join(given)}: only with --backend ray")
        return None
    from coordinator.sim.ray_backend import RayOptions

    return RayOptions(
        address=args.ray_address,
        agents_per_actor=args.agents_per_actor,
        actor_cpus=1.0 if args.actor_cpus is None else args.actor_cpus,
        actor_gpus=0.0 if args.actor_gpus is None else args.actor_gpus,
        broker=args.broker,
        threads=args.threads,
    )
