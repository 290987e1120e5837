"""Local datasets of an edge agent: loading by name, seeded partitions, federated splits.

Numpy-only (torch and torchvision are imported lazily, for resized or torchvision sources)::

    dataset = load_dataset("digits")
    spec = make_partition_spec("dirichlet:0.5", num_clients=6, seed=0, global_test_size=360)
    split = make_federated_split(dataset, spec)
    train, test = split.client(2)
"""

from edge_agent.data.dataset import ArrayDataset, resize_images
from edge_agent.data.loaders import (
    DATASETS,
    list_datasets,
    load_dataset,
    load_images,
    load_npz,
    save_npz,
)
from edge_agent.data.partition import MAX_DIRICHLET_DRAWS, SCHEMES, Scheme, partition
from edge_agent.data.partition_file import (
    PartitionFile,
    load_partition_file,
    save_partition_file,
    split_from_file,
)
from edge_agent.data.spec import (
    PartitionFields,
    PartitionSpec,
    make_partition_spec,
    parse_partition,
)
from edge_agent.data.split import FederatedSplit, make_federated_split

__all__ = [
    "DATASETS",
    "MAX_DIRICHLET_DRAWS",
    "SCHEMES",
    "ArrayDataset",
    "FederatedSplit",
    "PartitionFields",
    "PartitionFile",
    "PartitionSpec",
    "Scheme",
    "list_datasets",
    "load_dataset",
    "load_images",
    "load_npz",
    "load_partition_file",
    "make_federated_split",
    "make_partition_spec",
    "parse_partition",
    "partition",
    "resize_images",
    "save_npz",
    "save_partition_file",
    "split_from_file",
]
