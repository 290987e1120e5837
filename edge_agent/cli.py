"""``edge-agent``: run one device of a federation.

Kept free of heavy imports at module level so that ``edge-agent --help`` is instant; torch and
the models load only once the arguments are parsed.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at run time: --help must stay instant
    from edge_agent.factory import AgentOptions

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``edge-agent`` argument parser."""
    p = argparse.ArgumentParser(
        prog="edge-agent",
        description="Run one edge device of an edgefl federation: register with the coordinator, "
        "train its own model on its private data, exchange compact knowledge over MQTT.",
    )
    p.add_argument("--broker", required=True, help="MQTT broker HOST[:PORT] (default port 1883)")
    p.add_argument("--id", dest="device_id", default=None, help="device id (default: hostname)")
    p.add_argument("--federation", default="default", help="federation name (topic namespace)")
    p.add_argument("--username", default=None, help="MQTT username")
    p.add_argument("--password", default=None, help="MQTT password")
    p.add_argument("--algorithm", default="fedproto", help="algorithm the coordinator runs")
    p.add_argument("--model", default="cnn_t1", help="architecture name (see `models` registry)")
    p.add_argument(
        "--feature-dim",
        type=int,
        default=64,
        help="shared feature size appended as a projection (0 = native features)",
    )
    p.add_argument(
        "--data",
        default="digits",
        help="built-in dataset (digits, mnist5k, mnist, fashion_mnist, cifar10, cifar100), "
        "an ImageFolder directory or an .npz file",
    )
    p.add_argument("--data-root", default=None, help="root directory of torchvision datasets")
    p.add_argument("--image-size", type=int, default=None, help="resize images to this size")
    p.add_argument(
        "--partition",
        default=None,
        help="simulate a shard: iid | dirichlet:ALPHA | pathological:K (needs --clients)",
    )
    p.add_argument("--clients", type=int, default=1, help="number of shards in the simulation")
    p.add_argument("--client-index", type=int, default=0, help="which shard is this device's")
    p.add_argument(
        "--global-test-size",
        type=int,
        default=360,
        help="held-out global test set size when simulating shards",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of partition, init and batching")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="checkpoint/outbox directory (default: ./edgefl-agent-ID)",
    )
    p.add_argument(
        "--export-dir",
        type=Path,
        default=None,
        help="write the final ONNX bundle here (default: STATE_DIR/export)",
    )
    p.add_argument("--no-export", action="store_true", help="skip the ONNX export at the end")
    p.add_argument("--stay", action="store_true", help="keep running after the run finishes")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``edge-agent``."""
    args = build_parser().parse_args(argv)
    level = logging.getLevelName(args.log_level.upper())  # a name it does not know: a str
    if not isinstance(level, int):
        print(
            f"edge-agent: error: --log-level: unknown level {args.log_level!r}; "
            "use DEBUG, INFO, WARNING, ERROR",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from protocol.errors import EdgeFLError

    try:
        return _run(args)
    except EdgeFLError as exc:
        print(f"edge-agent: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    import socket

    from protocol.codec import Envelope, encode
    from protocol.messages import Status
    from protocol.mqtt import MqttTransport, parse_broker
    from protocol.topics import Topics, validate_id
    from protocol.transport import Will

    device_id = validate_id(args.device_id or socket.gethostname().split(".")[0], "--id")
    host, port = parse_broker(args.broker)
    topics = Topics(args.federation)
    will = Will(
        topics.status(device_id),
        encode(
            Envelope(body=Status(state="offline"), sender=device_id, federation=args.federation)
        ),
    )
    opts = _options(args, device_id)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from edge_agent.factory import build_agent

    transport = MqttTransport(
        host=host,
        port=port,
        client_id=f"edgefl-{args.federation}-{device_id}",
        will=will,
        username=args.username,
        password=args.password,
    )
    agent = build_agent(opts, transport)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    agent.start()  # subscriptions before connecting: the broker's queued tasks arrive at once
    transport.connect()
    try:
        agent.run(stop)
    except KeyboardInterrupt:
        pass
    finally:
        transport.close()
    return 0


def _options(args: argparse.Namespace, device_id: str) -> AgentOptions:
    from edge_agent.data import PartitionSpec, parse_partition
    from edge_agent.factory import AgentOptions

    partition = None
    if args.partition:
        partition = PartitionSpec(
            **parse_partition(args.partition),
            num_clients=args.clients,
            seed=args.seed,
            global_test_size=args.global_test_size,
        )
    state_dir = args.state_dir or Path(f"edgefl-agent-{device_id}")
    export_dir = None if args.no_export else (args.export_dir or state_dir / "export")
    return AgentOptions(
        device_id=device_id,
        algorithm=args.algorithm,
        model=args.model,
        feature_dim=args.feature_dim or None,
        data=args.data,
        data_root=args.data_root,
        image_size=args.image_size,
        partition=partition,
        client_index=args.client_index,
        federation=args.federation,
        state_dir=state_dir,
        export_dir=export_dir,
        device=args.device,
        seed=args.seed,
        exit_when_finished=not args.stay,
    )


if __name__ == "__main__":
    sys.exit(main())
