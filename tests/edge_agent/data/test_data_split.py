"""PartitionSpec, the --partition parser and federated splits (global test + client shards)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_agent.data import (
    ArrayDataset,
    PartitionSpec,
    load_dataset,
    make_federated_split,
    make_partition_spec,
    parse_partition,
    save_npz,
)
from protocol.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


def _synthetic(n_per_class: int = 60, num_classes: int = 10) -> ArrayDataset:
    y = np.repeat(np.arange(num_classes, dtype=np.int64), n_per_class)
    x = np.linspace(0, 1, len(y) * 4, dtype=np.float32).reshape(-1, 1, 2, 2)
    return ArrayDataset(x, y, num_classes, tuple(map(str, range(num_classes))), "synthetic")


# ----- spec and parser ---------------------------------------------------------------------------
def test_spec_dict_round_trip_through_json() -> None:
    spec = PartitionSpec(scheme="dirichlet", alpha=1, num_clients=6, seed=4, global_test_size=50)
    data = json.loads(json.dumps(spec.to_dict()))
    assert data["alpha"] == 1.0 and isinstance(data["alpha"], float)
    assert PartitionSpec.from_dict(data) == spec
    assert PartitionSpec.from_dict({"num_clients": 3}) == PartitionSpec(num_clients=3)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"clients": 3}, r"unknown keys \['clients'\]"),
        ({"scheme": "shards"}, "partition.scheme: expected one of iid, dirichlet, pathological"),
        ({"num_clients": True}, "partition.num_clients: expected an int >= 1"),
        ({"num_clients": 2.0}, "partition.num_clients: expected an int >= 1"),
        ({"alpha": 0}, "partition.alpha: expected a finite number > 0"),
        ({"alpha": "0.5"}, "partition.alpha: expected a number"),
        ({"test_fraction": 1.0}, r"partition.test_fraction: expected a number in \[0, 1\)"),
        ({"seed": -1}, "partition.seed: expected an int >= 0"),
    ],
)
def test_spec_rejects_bad_values(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PartitionSpec.from_dict(data)


@pytest.mark.parametrize(
    ("text", "fields"),
    [
        ("iid", {"scheme": "iid"}),
        ("dirichlet", {"scheme": "dirichlet"}),
        ("dirichlet:0.5", {"scheme": "dirichlet", "alpha": 0.5}),
        (" Dirichlet:1e-1 ", {"scheme": "dirichlet", "alpha": 0.1}),
        ("pathological:2", {"scheme": "pathological", "classes_per_client": 2}),
    ],
)
def test_parse_partition(text: str, fields: dict[str, object]) -> None:
    assert parse_partition(text) == fields


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("iid:3", "iid takes no parameter"),
        ("dirichlet:abc", "dirichlet:ALPHA needs a number > 0, got 'abc'"),
        ("dirichlet:-1", "needs a number > 0"),
        ("dirichlet:nan", "needs a number > 0"),
        ("pathological:1.5", "pathological:K needs an integer K >= 1"),
        ("pathological:0", "needs an integer K >= 1"),
        ("dirchlet:0.5", r"did you mean dirichlet\?"),
    ],
)
def test_parse_partition_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_partition(text)


def test_make_partition_spec_from_cli_values() -> None:
    spec = make_partition_spec("pathological:3", num_clients=6, seed=2, global_test_size=10)
    assert spec == PartitionSpec(
        scheme="pathological", classes_per_client=3, num_clients=6, seed=2, global_test_size=10
    )


# ----- federated split ---------------------------------------------------------------------------
def test_digits_split_as_in_the_fedvtc_reproduction() -> None:
    ds = load_dataset("digits")
    spec = make_partition_spec("dirichlet:0.1", num_clients=10, global_test_size=360)
    split = make_federated_split(ds, spec)
    # the global test set: 360 samples, stratified, disjoint from every client
    assert len(split.global_test_indices) == 360
    counts = split.global_test.class_counts()
    assert counts.min() >= 35 and counts.max() <= 37
    client_idx = np.concatenate(split.client_train_indices + split.client_test_indices)
    assert np.intersect1d(split.global_test_indices, client_idx).size == 0
    everything = np.concatenate([split.global_test_indices, client_idx])
    np.testing.assert_array_equal(np.sort(everything), np.arange(len(ds)))
    for k in range(10):
        train, test = split.client(k)
        assert len(train) + len(test) >= spec.min_size
        assert abs(len(test) - 0.2 * (len(train) + len(test))) <= 1 + train.num_classes
        # every class a client tests on is also in its training set
        assert set(np.unique(test.y)) <= set(np.unique(train.y))


def test_split_is_deterministic_and_seed_dependent() -> None:
    ds = _synthetic()
    spec = PartitionSpec(scheme="dirichlet", alpha=0.3, num_clients=5, global_test_size=100)
    a, b = make_federated_split(ds, spec), make_federated_split(ds, spec)
    assert a.digest() == b.digest() and a.summary() == b.summary()
    for x, y in zip(a.client_train_indices, b.client_train_indices, strict=True):
        np.testing.assert_array_equal(x, y)
    other = make_federated_split(ds, PartitionSpec.from_dict({**spec.to_dict(), "seed": 1}))
    assert other.digest() != a.digest()


def test_split_is_identical_in_another_process(tmp_path: Path) -> None:
    path = save_npz(_synthetic(), tmp_path / "fleet.npz")
    spec = PartitionSpec(scheme="dirichlet", alpha=0.5, num_clients=4, seed=7, global_test_size=60)
    code = (
        "import json, sys\n"
        "from edge_agent.data import PartitionSpec, load_dataset, make_federated_split\n"
        "spec = PartitionSpec.from_dict(json.loads(sys.argv[2]))\n"
        "print(make_federated_split(load_dataset(sys.argv[1]), spec).digest())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path), json.dumps(spec.to_dict())],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip() == make_federated_split(load_dataset(str(path)), spec).digest()


def test_summary_is_json_and_counts_add_up() -> None:
    ds = _synthetic()
    split = make_federated_split(
        ds,
        PartitionSpec(
            scheme="pathological", classes_per_client=2, num_clients=5, global_test_size=50
        ),
    )
    summary = json.loads(json.dumps(split.summary()))
    assert summary["spec"]["scheme"] == "pathological" and summary["dataset"] == "synthetic"
    assert summary["global_test"]["size"] == 50
    total = summary["global_test"]["size"] + sum(
        c["train_size"] + c["test_size"] for c in summary["clients"]
    )
    assert total == len(ds)
    for c in summary["clients"]:
        assert sum(c["train_class_counts"]) == c["train_size"]
        assert sum(1 for n in c["train_class_counts"] if n) == 2  # pathological: 2 classes


def test_no_global_test_and_no_local_test() -> None:
    split = make_federated_split(_synthetic(), PartitionSpec(num_clients=3, test_fraction=0.0))
    assert len(split.global_test) == 0 and split.global_test.input_shape == (1, 2, 2)
    assert all(len(t) == 0 for t in split.client_test_indices)
    assert sum(len(t) for t in split.client_train_indices) == 600


def test_client_index_out_of_range() -> None:
    split = make_federated_split(_synthetic(), PartitionSpec(num_clients=3))
    with pytest.raises(ConfigError, match=r"client index must be an int in \[0, 3\), got 3"):
        split.client(3)


def test_global_test_larger_than_the_dataset() -> None:
    with pytest.raises(ConfigError, match="leaves no samples"):
        make_federated_split(_synthetic(), PartitionSpec(global_test_size=600))


def test_too_few_samples_left_for_min_size() -> None:
    with pytest.raises(ConfigError, match="cannot give 10 clients at least 10"):
        make_federated_split(_synthetic(), PartitionSpec(num_clients=10, global_test_size=550))
