"""Assemble an agent from options: data shard, model, algorithm, device, endpoint.

Used by the ``edge-agent`` CLI and by in-process simulation, so both run the same code.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from edge_agent.agent import AgentSettings, EdgeAgent
from edge_agent.algorithms import EdgeContext, create_edge_algorithm
from edge_agent.data import (
    ArrayDataset,
    FederatedSplit,
    PartitionSpec,
    load_dataset,
    load_partition_file,
    make_federated_split,
    split_from_file,
)
from edge_agent.trainer import TensorData
from models import create_model
from models.checkpoint import ModelSpec
from models.seeding import seeded
from protocol.algorithms.base import DEFAULT_FEATURE_DIM
from protocol.contract.messages import CoordinatorState
from protocol.errors import ConfigError
from protocol.transport.base import Transport
from protocol.transport.endpoint import Endpoint

if TYPE_CHECKING:
    from protocol.security.keys import SigningKeys

__all__ = [
    "UNSIGNED_KINDS",
    "AgentOptions",
    "build_agent",
    "describe_data",
    "map_classes",
    "pick_device",
]

# what an agent accepts unsigned when it requires signatures: the coordinator's last will,
# which the broker publishes long after it was made; the agent takes it as a hint only
UNSIGNED_KINDS = frozenset({CoordinatorState.KIND})


@dataclass(frozen=True)
class AgentOptions:
    """Everything that defines one agent (the CLI's flags, typed)."""

    device_id: str
    algorithm: str = "fedproto"  # the coordinator's default too
    model: str = "cnn_t1"
    feature_dim: int | None = DEFAULT_FEATURE_DIM
    feature_act: str | None = None  # "relu": non-negative projected features (Felo spec §9)
    data: str = "digits"
    data_root: str | None = None
    image_size: int | None = None
    partition: PartitionSpec | None = None  # None: the whole dataset is this device's own
    # a split file (edge_agent.data.partition_file): client_index's arrays; wins over partition
    partition_file: Path | None = None
    client_index: int = 0
    federation: str = "default"
    state_dir: Path = Path("agent-state")
    export_dir: Path | None = None
    device: str = "auto"
    seed: int = 0
    eval_every: int = 1  # evaluate every N-th training round (and every other phase)
    global_eval_every: int = 1  # score the global test set every N-th training round
    exit_when_finished: bool = True
    # the federation's classes, by name and in order: local labels are mapped onto them by name
    # (empty: the dataset's own numbering, which must then agree across the fleet)
    classes: tuple[str, ...] = ()
    # register the label histogram, only the class set, or (None) whichever the run's state
    # asks for (``AgentSettings.class_counts``)
    class_counts: bool | None = True


def pick_device(name: str) -> torch.device:
    """``auto`` -> CUDA when present, else CPU; an explicit ``cuda`` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda requested but torch sees no CUDA device")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda[:N], got {name!r}")
    return torch.device(name)


def _tensors(ds: ArrayDataset, device: torch.device) -> TensorData:
    return TensorData(
        torch.as_tensor(ds.x, device=device), torch.as_tensor(ds.y, dtype=torch.long, device=device)
    )


class SplitCache:
    """The federated splits of one process, computed once for all the agents it runs.

    A device computes its shard from the shared partition spec, the whole split and then its
    part. A process that runs many simulated agents (the in-process backend, a Ray actor)
    did that once per agent: O(agents^2), and ~4 minutes to start 500 agents of a
    1,000-agent mnist5k fleet. Kept by the caller, never module-wide: an ``edge-agent``
    process must not hold the whole dataset once its shard is cut.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._splits: dict[tuple[object, ...], FederatedSplit] = {}

    def get(self, opts: AgentOptions) -> FederatedSplit:
        """The split ``opts`` names (its data, and partition spec or file)."""
        key = (opts.data, opts.data_root, opts.image_size, opts.partition, opts.partition_file)
        with self._lock:  # agents start one after another: nothing waits here in practice
            split = self._splits.get(key)
            if split is None:
                split = self._splits[key] = _split(opts)
            return split


def _split(opts: AgentOptions) -> FederatedSplit:
    dataset = load_dataset(opts.data, root=opts.data_root, image_size=opts.image_size)
    if opts.partition_file is not None:
        return split_from_file(dataset, load_partition_file(opts.partition_file))
    assert opts.partition is not None  # the caller's check
    return make_federated_split(dataset, opts.partition)


def _shards(
    opts: AgentOptions, splits: SplitCache | None
) -> tuple[ArrayDataset, ArrayDataset, ArrayDataset | None]:
    if opts.partition_file is None and opts.partition is None:
        dataset = load_dataset(opts.data, root=opts.data_root, image_size=opts.image_size)
        rng = np.random.default_rng(opts.seed)
        order = rng.permutation(len(dataset.y))
        cut = int(0.8 * len(order))
        return dataset.subset(order[:cut]), dataset.subset(order[cut:]), None
    split = _split(opts) if splits is None else splits.get(opts)
    train, test = split.client(opts.client_index)
    if opts.partition_file is not None and not len(split.global_test_indices):
        return train, test, None
    return train, test, split.global_test


def map_classes(ds: ArrayDataset, classes: tuple[str, ...]) -> ArrayDataset:
    """``ds`` with its labels renumbered onto the federation's ``classes``, matched by name.

    Devices must mean the same thing by a class index: an image folder numbers its folders
    alphabetically (zero..nine becomes eight, five, four, ...) and a device may lack classes
    altogether (no folder). Mapped by name, every device uses the federation's numbering and
    class count; classes it has no samples of are label skew, the normal case.

    Raises:
        ConfigError: a local class name the federation does not declare, or duplicate names.
    """
    if len(set(classes)) != len(classes):
        dup = sorted({c for c in classes if classes.count(c) > 1})
        raise ConfigError(f"--classes: duplicate class names {dup}")
    index = {name: i for i, name in enumerate(classes)}
    present = sorted({ds.class_names[int(c)] for c in np.unique(ds.y)})
    unknown = [name for name in present if name not in index]
    if unknown:
        raise ConfigError(
            f"data {ds.name}: classes {unknown} are not among the federation's classes "
            f"{list(classes)}; rename them or fix --classes"
        )
    lookup = np.asarray([index.get(name, -1) for name in ds.class_names], dtype=np.int64)
    return ArrayDataset(ds.x, lookup[ds.y], len(classes), tuple(classes), ds.name)


def describe_data(
    opts: AgentOptions, train: ArrayDataset, test: ArrayDataset, global_test: ArrayDataset | None
) -> str:
    """One log line: what was loaded, how it was split, samples per class (by name)."""
    counts = np.bincount(train.y, minlength=train.num_classes)
    per_class = ", ".join(
        f"{name} {n}" for name, n in zip(train.class_names, counts.tolist(), strict=True) if n
    )
    if opts.partition_file is not None:
        split = f"client {opts.client_index} of partition file {opts.partition_file}"
    elif opts.partition is None:
        split = "80/20 train/test split of the whole dataset"
    else:
        split = (
            f"{_scheme(opts.partition)} shard {opts.client_index} of {opts.partition.num_clients}"
        )
    shape = "x".join(str(int(d)) for d in train.x.shape[1:])
    held_out = "" if global_test is None else f", global test {len(global_test.y)}"
    return (
        f"data {train.name}: {split}; {train.num_classes} classes, input {shape}; "
        f"train {len(train.y)}, test {len(test.y)}{held_out}; train per class: {per_class}"
    )


def _scheme(p: PartitionSpec) -> str:
    if p.scheme == "dirichlet":
        return f"dirichlet:{p.alpha:g}"
    return f"pathological:{p.classes_per_client}" if p.scheme == "pathological" else p.scheme


def build_agent(
    opts: AgentOptions,
    transport: Transport,
    logger: logging.Logger | None = None,
    *,
    signing: SigningKeys | None = None,
    splits: SplitCache | None = None,
) -> EdgeAgent:
    """Load this device's data shard, build its model and algorithm, wire the endpoint.

    ``signing``: sign every frame and refuse unsigned ones except the coordinator's will (§7).
    ``splits``: where a process that builds many agents keeps the split they share.
    """
    device = pick_device(opts.device)
    train, test, global_test = _shards(opts, splits)
    if opts.classes:
        train, test = map_classes(train, opts.classes), map_classes(test, opts.classes)
        global_test = None if global_test is None else map_classes(global_test, opts.classes)
    (logger or logging.getLogger(f"edgefl.agent.{opts.device_id}")).info(
        "%s", describe_data(opts, train, test, global_test)
    )
    c, h, _w = train.x.shape[1:]
    build = functools.partial(
        create_model,
        opts.model,
        num_classes=train.num_classes,
        in_chans=int(c),
        feature_dim=opts.feature_dim,
        input_size=int(h),
        feature_act=opts.feature_act,
    )
    # model and algorithm init differ per device and are reproducible (thread-safe: simulate);
    # algorithms that average weights re-initialise shared modules from a common seed
    with seeded(opts.seed * 1009 + opts.client_index):
        model = build().to(device)
        gen = torch.Generator().manual_seed(opts.seed * 7919 + opts.client_index)
        ctx = EdgeContext(
            model=model,
            train=_tensors(train, device),
            test=_tensors(test, device),
            num_classes=train.num_classes,
            device=device,
            generator=gen,
            global_test=None if global_test is None else _tensors(global_test, device),
            model_builder=build,
        )
        algorithm = create_edge_algorithm(opts.algorithm, ctx)
    spec = ModelSpec.from_model(model)
    options = {} if signing is None else signing.endpoint_options(UNSIGNED_KINDS)
    endpoint = Endpoint(transport, sender=opts.device_id, federation=opts.federation, **options)
    settings = AgentSettings(
        device_id=opts.device_id,
        state_dir=opts.state_dir,
        federation=opts.federation,
        exit_when_finished=opts.exit_when_finished,
        eval_every=opts.eval_every,
        global_eval_every=opts.global_eval_every,
        export_dir=opts.export_dir,
        class_names=train.class_names,
        class_counts=opts.class_counts,
    )
    return EdgeAgent(endpoint, algorithm, spec, settings, logger)
