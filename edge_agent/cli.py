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
from typing import TYPE_CHECKING, Any

from edge_agent.joining import Adopted, adopt, class_list, feature_size, wait_for_run
from protocol.algorithms.base import DEFAULT_FEATURE_DIM
from protocol.cli_args import non_negative_int
from protocol.logs import setup_logging

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
    p.add_argument(
        "--broker",
        default=None,
        help="MQTT broker HOST[:PORT] (default port 1883; or the kit's) or URL mqtt://, "
        "mqtts://, ws://, wss://HOST[:PORT][/PATH] (WebSockets: path /mqtt by default)",
    )
    p.add_argument(
        "--id", dest="device_id", default=None, help="device id (default: the kit's, else hostname)"
    )
    p.add_argument(
        "--federation", default=None, help="federation name (topic namespace; default: the kit's)"
    )
    _credential_options(p)
    p.add_argument(
        "--algorithm",
        default=None,
        help="pin the algorithm (default: adopt the one the federation's coordinator runs)",
    )
    p.add_argument(
        "--connect-retry",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="keep trying an unreachable broker this long at start-up (0 = fail at once)",
    )
    p.add_argument("--model", default="cnn_t1", help="architecture name (see `models` registry)")
    p.add_argument(
        "--feature-dim",
        type=int,
        default=None,
        help="shared feature size appended as a projection (0 = native features; default: "
        f"the one the run's algorithm requires, else {DEFAULT_FEATURE_DIM})",
    )
    p.add_argument(
        "--feature-act",
        choices=["none", "relu"],
        default="none",
        help="activation after the projection (relu: non-negative features, as pooled CNN ones)",
    )
    p.add_argument(
        "--data",
        default="digits",
        help="built-in dataset (digits, mnist5k, mnist, fashion_mnist, cifar10, cifar100), "
        "an ImageFolder directory or an .npz file",
    )
    p.add_argument(
        "--classes",
        default=None,
        metavar="NAMES",
        help="the federation's classes in order, comma-separated or @FILE (one a line); local "
        "labels are mapped onto them by name (default: the classes the coordinator names, else "
        "the dataset's own numbering)",
    )
    p.add_argument("--data-root", default=None, help="root directory of torchvision datasets")
    p.add_argument("--image-size", type=int, default=None, help="resize images to this size")
    p.add_argument(
        "--partition",
        default=None,
        help="simulate a shard: iid | dirichlet:ALPHA | pathological:K (needs --clients)",
    )
    p.add_argument(
        "--partition-file",
        type=Path,
        default=None,
        help="this device's shard from a split file: arrays train_idx_K / test_idx_K (and "
        "optional global_test_idx) over --data; K is --client",
    )
    p.add_argument(
        "--clients",
        type=int,
        default=None,
        help="number of shards in the simulation (with --partition-file: must match the file)",
    )
    p.add_argument(
        "--client",
        "--client-index",
        dest="client_index",
        type=int,
        default=None,
        help="which shard is this device's, 0..N-1 (needed with --partition-file, and with "
        "--partition over --clients N > 1)",
    )
    p.add_argument(
        "--global-test-size",
        type=int,
        default=360,
        help="held-out global test set size when simulating shards",
    )
    p.add_argument("--test-fraction", type=float, default=0.2, help="local test share of a shard")
    p.add_argument("--min-size", type=int, default=10, help="fewest samples a shard may get")
    p.add_argument(
        "--partition-seed", type=int, default=None, help="seed of the shards (default: --seed)"
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=1,
        metavar="N",
        help="evaluate every N-th training round (and always at the end)",
    )
    p.add_argument(
        "--global-eval-every",
        type=int,
        default=1,
        metavar="N",
        help="score the global test set only every N-th training round (and always at the end)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of partition, init and batching")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument(
        "--threads",
        type=non_negative_int,
        default=0,
        help="CPU threads of torch's pool and NumPy's BLAS (0 = their defaults, one a core; "
        "several agents on one machine: 1 each)",
    )
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
    p.add_argument(
        "--stay",
        "--daemon",
        dest="stay",
        action="store_true",
        help="a daemon: after a run, archive its state and take part in the next one",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    p.add_argument(
        "--log-format", choices=("text", "json"), default="text", help="json: one object a line"
    )
    return p


def _credential_options(p: argparse.ArgumentParser) -> None:
    from protocol.security.credentials import ENV
    from protocol.security.flags import add_arguments

    add_arguments(p)
    p.add_argument("--username", default=None, help=f"MQTT username (or ${ENV['username']})")
    # a password on the command line is visible to every user in `ps`: refused, with the way out
    p.add_argument("--password", default=None, help=argparse.SUPPRESS)


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
    setup_logging(level, args.log_format)
    from protocol.errors import EdgeFLError

    try:
        return _run(args)
    except EdgeFLError as exc:
        print(f"edge-agent: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


EXIT_ERROR = 2  # bad options, unreachable broker, unreadable data, insecure broker
EXIT_REFUSED = 3  # the coordinator refused this agent (the reason is logged)
EXIT_GAVE_UP = 4  # the run ended before its last round (the coordinator gave up)
EXIT_UNCONFIRMED = 5  # a "finished" this agent cannot confirm: it did not do the final phase
EXIT_SIGNAL = 128  # + the signal's number: stopped by SIGINT (130) or SIGTERM (143)
_END_CODES = {"completed": 0, "gave_up": EXIT_GAVE_UP, "unconfirmed": EXIT_UNCONFIRMED}


class StopRequest:
    """The signal handler of SIGTERM and SIGINT: the first asks the agent to stop (the training
    loop sees it within one batch); a second stops at once (``KeyboardInterrupt``)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum = 0

    def __call__(self, signum: int, _frame: object) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt
        self.signum = signum
        self.event.set()
        logging.getLogger("edgefl.agent").warning(
            "%s: stopping after the current batch (send it again to stop at once)",
            signal.Signals(signum).name,
        )

    @property
    def exit_code(self) -> int:
        """The conventional status of a process ended by the signal: 128 + its number."""
        return EXIT_SIGNAL + self.signum


def _run(args: argparse.Namespace) -> int:
    import socket

    from protocol.contract.topics import validate_id
    from protocol.security.mode import connection_mode
    from protocol.transport.address import parse_broker

    args.creds = _credentials(args)
    device_id = validate_id(args.device_id or socket.gethostname().split(".")[0], "--id")
    args.signing = _signing(args, device_id)
    broker = parse_broker(args.broker)  # a bad address fails before the data is loaded
    mode = connection_mode(
        broker, args.creds, signing=args.signing is not None, insecure=args.insecure
    )
    mode.announce(logging.getLogger("edgefl.agent"))
    from models.cpu_threads import apply_thread_setting

    apply_thread_setting(args.threads, agents=1)
    lock = _lock_state_dir(_state_dir(args, device_id), device_id)
    stop = StopRequest()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    try:
        while not stop.event.is_set():
            code = _one_run(args, device_id, stop.event)
            if not args.stay or code == EXIT_REFUSED:
                break
    except KeyboardInterrupt:  # a second signal: stopped at once
        pass
    finally:  # main() may run inside another program (the tests)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        lock.release()
    return stop.exit_code if stop.event.is_set() else code


AGENT_LOCK = "agent.lock"  # in the state directory; holds the pid of the agent using it


def _state_dir(args: argparse.Namespace, device_id: str) -> Path:
    return Path(args.state_dir or f"edgefl-agent-{device_id}")


def _lock_state_dir(state_dir: Path, device_id: str) -> Any:
    """One agent process per state directory. Two agents on one (two default agents in one
    directory of one host: both named after the host) would share an outbox and checkpoints
    and take each other's MQTT session, silently; the second one is refused at start."""
    from protocol.dir_lock import DirBusyError, DirLock

    message = (
        f"{{directory}} is in use by another edge-agent (pid {{pid}}) as device {device_id!r}: "
        "give each agent its own --id (every device of a federation needs a unique one) "
        "or --state-dir"
    )
    return DirLock(state_dir, AGENT_LOCK, (DirBusyError, message))


def _credentials(args: argparse.Namespace) -> Any:
    """Credentials from --kit/--credentials/EDGEFL_*; the kit also gives id, federation, broker.

    Fills ``args.device_id``, ``args.federation`` and ``args.broker`` where they were not given.
    """
    from protocol.errors import ConfigError
    from protocol.security.credentials import ENV, load_credentials

    if args.password is not None:
        raise ConfigError(
            "--password: a password on the command line is visible to every user in `ps`; "
            f"set ${ENV['password']} or put it in a --credentials file ([mqtt] password)"
        )
    creds = load_credentials(kit=args.kit, credentials_file=args.credentials)
    kit = creds.kit
    if kit is not None:
        if kit.role != "device":
            raise ConfigError(f"kit {kit.path} is the coordinator's; edge-agent needs a device kit")
        for flag, name, value in (
            ("--id", "device_id", kit.id),
            ("--federation", "federation", kit.federation),
        ):
            given = getattr(args, name)
            if given is not None and given != value:
                raise ConfigError(
                    f"{flag} {given}: the kit {kit.path} is for {value!r} (its certificate and "
                    "the broker's ACL allow no other)"
                )
            setattr(args, name, value)
        args.broker = args.broker or kit.broker
    if args.broker is None:
        raise ConfigError(
            "--broker: expected HOST[:PORT] or a broker URL (or a --kit that names the broker)"
        )
    args.federation = args.federation or "default"
    logging.getLogger("edgefl.agent").info("broker credentials: %s", creds.describe())
    return creds


def _signing(args: argparse.Namespace, device_id: str) -> Any:
    """The kit's signing keys (``None``: frames unsigned); ``--no-signing`` turns them off."""
    from protocol.security.keys import load_signing

    return load_signing(args.creds, device_id, enabled=not args.no_signing)


def _transport(args: argparse.Namespace, device_id: str) -> Any:
    from protocol.contract.codec import Envelope, encode
    from protocol.contract.messages import Status
    from protocol.contract.topics import Topics
    from protocol.transport.address import parse_broker
    from protocol.transport.base import Will
    from protocol.transport.paho import MqttTransport

    status = Envelope(body=Status(state="offline"), sender=device_id, federation=args.federation)
    options = parse_broker(args.broker).client_options(args.creds.transport_options())
    if args.username:  # a user name is no secret: the command line may give it
        options["username"] = args.username
    return MqttTransport(
        client_id=f"edgefl-{args.federation}-{device_id}",
        will=Will(Topics(args.federation).status(device_id), encode(status)),
        **options,
    )


def _one_run(args: argparse.Namespace, device_id: str, stop: threading.Event) -> int:
    """Build a fresh agent, take part in one run, and say how it ended (an exit code).

    The agent is built before connecting, so bad data or a bad model fail at once; an agent
    that adopts the run's algorithm or classes is rebuilt if the run differs from its guess
    (and then also takes the feature size the run requires, unless ``--feature-dim`` is given).
    """
    from edge_agent.factory import build_agent

    transport = _transport(args, device_id)
    try:
        guess = Adopted(
            args.algorithm or "fedproto",
            class_list(args.classes) if args.classes else (),
            feature_size(args.feature_dim),
        )
        opts = _options(args, device_id, guess)
        agent = build_agent(opts, transport, signing=args.signing)
        if args.algorithm is None or not guess.classes:
            state = wait_for_run(args, transport, stop, agent)
            if state is None:  # stopped while waiting, or the run it had joined ended
                return _exit_code(agent)
            adopted = adopt(args, state)
            if adopted != guess:
                opts = _options(args, device_id, adopted)
                agent = build_agent(opts, transport, signing=args.signing)
        agent.start()  # subscriptions before connecting: the broker's queued tasks arrive at once
        if not transport.connected:
            transport.connect(retry_for=args.connect_retry)
        agent.run(stop)
    finally:
        transport.close()
    return _exit_code(agent)


def _exit_code(agent: Any) -> int:
    """How the agent's part in the run ended, as an exit code (0 only for a completed run, or
    for no end at all: the caller then says it was stopped)."""
    if agent.refusal is not None:
        return EXIT_REFUSED
    return 0 if agent.end is None else _END_CODES[agent.end.kind]


def _options(args: argparse.Namespace, device_id: str, run: Adopted) -> AgentOptions:
    from edge_agent.data import PartitionSpec, parse_partition
    from edge_agent.factory import AgentOptions
    from protocol.errors import ConfigError

    partition = None
    if args.partition_file is not None:
        from edge_agent.data import load_partition_file

        pf = load_partition_file(args.partition_file, num_clients=args.clients)
        client = _client_index(args, pf.num_clients, f"the partition file {args.partition_file}")
    elif args.partition:
        if args.clients is None:
            raise ConfigError(
                f"--partition {args.partition}: needs --clients N (how many shards the data is "
                "split into) and --client K (this device's)"
            )
        client = _client_index(args, args.clients, f"the {args.partition} split")
        partition = PartitionSpec(
            **parse_partition(args.partition),
            num_clients=args.clients,
            seed=args.seed if args.partition_seed is None else args.partition_seed,
            min_size=args.min_size,
            test_fraction=args.test_fraction,
            global_test_size=args.global_test_size,
        )
    elif args.client_index is not None:
        raise ConfigError(
            f"--client {args.client_index}: picks a shard of --partition-file or --partition; "
            "without either the agent trains on all of --data"
        )
    else:
        client = 0
    state_dir = _state_dir(args, device_id)
    export_dir = None if args.no_export else (args.export_dir or state_dir / "export")
    return AgentOptions(
        device_id=device_id,
        algorithm=run.algorithm,
        model=args.model,
        feature_dim=run.feature_dim,
        feature_act=None if args.feature_act == "none" else args.feature_act,
        data=args.data,
        data_root=args.data_root,
        image_size=args.image_size,
        partition=partition,
        partition_file=args.partition_file,
        client_index=client,
        federation=args.federation,
        state_dir=state_dir,
        export_dir=export_dir,
        device=args.device,
        seed=args.seed,
        eval_every=args.eval_every,
        global_eval_every=args.global_eval_every,
        exit_when_finished=not args.stay,
        classes=run.classes,
        class_counts=None,  # the run's state says whether its algorithm reads the histogram
    )


def _client_index(args: argparse.Namespace, clients: int, split: str) -> int:
    """This device's shard of a split into ``clients``: ``--client``, which only a split of
    one shard may leave out (else every device so started would train shard 0)."""
    from protocol.errors import ConfigError

    if args.client_index is None:
        if clients == 1:
            return 0
        raise ConfigError(
            f"--client: which of the {clients} shards of {split} is this device's "
            f"(0..{clients - 1})"
        )
    if not 0 <= args.client_index < clients:
        raise ConfigError(f"--client {args.client_index}: {split} holds clients 0..{clients - 1}")
    return int(args.client_index)


if __name__ == "__main__":
    sys.exit(main())
