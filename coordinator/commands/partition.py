"""``coordinator partition``: a seeded split written as a partition file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.commands.options import add_log_options

if TYPE_CHECKING:
    from coordinator.commands.options import Subparsers

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> None:
    """``coordinator partition``: our seeded split written as a partition file."""
    part = sub.add_parser(
        "partition", help="write a seeded split as a partition file (train_idx_K / test_idx_K)"
    )
    part.add_argument("--data", default="digits", help="dataset the indices refer to")
    part.add_argument("--data-root", default=None, help="root directory of torchvision datasets")
    part.add_argument("--clients", type=int, required=True, help="number of clients")
    part.add_argument(
        "--partition", default="dirichlet:0.5", help="iid | dirichlet:A | pathological:K"
    )
    part.add_argument("--alpha", type=float, default=None, help="shorthand for dirichlet:ALPHA")
    part.add_argument("--seed", type=int, default=0, help="seed of the split")
    part.add_argument("--test-fraction", type=float, default=0.2, help="local test share")
    part.add_argument("--min-size", type=int, default=10, help="fewest samples per client")
    part.add_argument("--global-test-size", type=int, default=0, help="held-out global test set")
    part.add_argument("--out", type=Path, required=True, help="the .npz to write")
    add_log_options(part)


def run(args: argparse.Namespace) -> int:
    """Write our seeded split in the partition-file format (to hand it to another toolkit)."""
    from edge_agent.data import (
        load_dataset,
        load_partition_file,
        make_federated_split,
        make_partition_spec,
        save_partition_file,
        split_from_file,
    )

    text = args.partition if args.alpha is None else f"dirichlet:{args.alpha}"
    spec = make_partition_spec(
        text,
        num_clients=args.clients,
        seed=args.seed,
        min_size=args.min_size,
        test_fraction=args.test_fraction,
        global_test_size=args.global_test_size,
    )
    dataset = load_dataset(args.data, root=args.data_root)
    split = make_federated_split(dataset, spec)
    path = save_partition_file(args.out, split)
    back = split_from_file(dataset, load_partition_file(path, num_clients=args.clients))
    sizes = [len(t) for t in split.client_train_indices]
    print(
        f"wrote {path}: {args.data} ({len(dataset)} samples), {text}, {args.clients} clients, "
        f"seed {args.seed}; train {min(sizes)}..{max(sizes)} per client, "
        f"global test {len(split.global_test_indices)}; split digest {back.digest()[:16]}"
    )
    return 0
