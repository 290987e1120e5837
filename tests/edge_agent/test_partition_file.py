"""Partition files: a user's own split, and our seeded split exported to it."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from edge_agent.data import (
    ArrayDataset,
    PartitionSpec,
    load_partition_file,
    make_federated_split,
    save_partition_file,
    split_from_file,
)
from protocol.errors import ConfigError


def _dataset(n: int = 200, classes: int = 4) -> ArrayDataset:
    rng = np.random.default_rng(0)
    x = rng.random((n, 1, 4, 4)).astype(np.float32)
    y = np.arange(n, dtype=np.int64) % classes
    return ArrayDataset(x, y, classes, tuple(str(c) for c in range(classes)), "toy")


def _write(path: Path, **arrays: object) -> Path:
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return path


def _spec(**kw: object) -> PartitionSpec:
    base: dict[str, object] = {
        "scheme": "dirichlet",
        "alpha": 0.3,
        "num_clients": 5,
        "seed": 1,
        "min_size": 10,
        "test_fraction": 0.25,
        "global_test_size": 20,
    }
    return PartitionSpec.from_dict({**base, **kw})


def test_export_load_roundtrip_gives_identical_indices(tmp_path: Path) -> None:
    ds = _dataset()
    split = make_federated_split(ds, _spec())
    path = save_partition_file(tmp_path / "split", split)
    assert path.name == "split.npz"
    pf = load_partition_file(path, num_clients=5)
    back = split_from_file(ds, pf)
    assert back.num_clients == split.num_clients
    for k in range(5):
        np.testing.assert_array_equal(back.client_train_indices[k], split.client_train_indices[k])
        np.testing.assert_array_equal(back.client_test_indices[k], split.client_test_indices[k])
        train, test = back.client(k)
        want_train, want_test = split.client(k)
        np.testing.assert_array_equal(train.y, want_train.y)
        np.testing.assert_array_equal(test.x, want_test.x)
    np.testing.assert_array_equal(back.global_test_indices, split.global_test_indices)
    assert split.spec is not None and pf.spec["spec"] == split.spec.to_dict()
    assert pf.spec["dataset"] == "toy"


def test_a_hand_made_file_without_global_test(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "f.npz",
        train_idx_0=np.array([5, 1, 2]),
        test_idx_0=np.array([3], np.int32),
        train_idx_1=np.array([10, 11]),
        test_idx_1=np.array([], np.int64),
    )
    pf = load_partition_file(path)
    assert pf.num_clients == 2
    np.testing.assert_array_equal(pf.train[0], [1, 2, 5])  # sorted, int64
    assert pf.train[0].dtype == np.int64
    assert pf.global_test.size == 0
    train, test = split_from_file(_dataset(), pf).client(1)
    assert len(train.y) == 2 and len(test.y) == 0


def test_without_a_global_test_set_the_clients_test_sets_together_are_it(tmp_path: Path) -> None:
    # HtFLlib's splits hold out nothing besides the clients' test sets: global = their union
    path = _write(
        tmp_path / "f.npz",
        train_idx_0=np.array([5, 1]),
        test_idx_0=np.array([7, 3]),
        train_idx_1=np.array([10, 11]),
        test_idx_1=np.array([2]),
    )
    split = split_from_file(_dataset(), load_partition_file(path))
    np.testing.assert_array_equal(split.global_test_indices, [2, 3, 7])
    held_out = tmp_path / "g.npz"
    _write(held_out, train_idx_0=np.array([5]), test_idx_0=np.array([7]), global_test_idx=[9])
    split = split_from_file(_dataset(), load_partition_file(held_out))
    np.testing.assert_array_equal(split.global_test_indices, [9])


def test_unknown_arrays_are_named_in_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _write(
        tmp_path / "f.npz",
        train_idx_0=np.array([0, 1]),
        test_idx_0=np.array([2]),
        client_sizes=np.array([3]),
        x=np.zeros(3),
    )
    with caplog.at_level(logging.WARNING, logger="edgefl.data"):
        load_partition_file(path)
    assert "['client_sizes', 'x']" in caplog.text


@pytest.mark.parametrize(
    ("arrays", "match"),
    [
        (
            {"train_idx_0": [0, 1], "test_idx_0": [2], "train_idx_2": [3], "test_idx_2": [4]},
            r"client 1 is missing train_idx_1, test_idx_1",
        ),
        (
            {"train_idx_0": [0, 1], "test_idx_0": [2], "train_idx_1": [3]},
            r"client 1 is missing test_idx_1",
        ),
        (
            {"train_idx_0": [0, 1], "test_idx_0": [1]},
            r"index 1 is in both train_idx_0 and test_idx_0",
        ),
        (
            {
                "train_idx_0": [0, 1],
                "test_idx_0": [2],
                "train_idx_1": [5],
                "test_idx_1": [6],
                "global_test_idx": [6, 7],
            },
            r"index 6 is in both test_idx_1 and global_test_idx",
        ),
        ({"train_idx_0": [0, 0, 1], "test_idx_0": [2]}, r"train_idx_0 repeats index 0"),
        ({"train_idx_0": [-1, 1], "test_idx_0": [2]}, r"train_idx_0 holds negative index -1"),
        ({"train_idx_0": [0.5, 1.0], "test_idx_0": [2]}, r"train_idx_0 must be a 1-D integer"),
        ({"train_idx_0": [[0, 1]], "test_idx_0": [2]}, r"train_idx_0 must be a 1-D integer"),
        ({"train_idx_0": [], "test_idx_0": [2]}, r"train_idx_0 is empty"),
        ({"x": [1]}, r"holds no train_idx_K"),
    ],
)
def test_precise_errors(tmp_path: Path, arrays: dict[str, list[object]], match: str) -> None:
    path = _write(tmp_path / "f.npz", **{k: np.asarray(v) for k, v in arrays.items()})
    with pytest.raises(ConfigError, match=match):
        load_partition_file(path)


def test_out_of_range_index_names_the_array_and_the_dataset(tmp_path: Path) -> None:
    path = _write(tmp_path / "f.npz", train_idx_0=np.array([0, 1]), test_idx_0=np.array([200]))
    pf = load_partition_file(path)
    with pytest.raises(ConfigError, match=r"test_idx_0 holds index 200, but dataset 'toy' has 200"):
        split_from_file(_dataset(200), pf)


def test_client_count_must_match_the_fleet(tmp_path: Path) -> None:
    path = save_partition_file(tmp_path / "s.npz", make_federated_split(_dataset(), _spec()))
    with pytest.raises(ConfigError, match=r"holds 5 clients .* but the fleet has 4"):
        load_partition_file(path, num_clients=4)


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_partition_file(tmp_path / "missing.npz")
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ConfigError, match=r"cannot read it as \.npz"):
        load_partition_file(bad)
    one = tmp_path / "one.npy"
    np.save(one, np.arange(3))
    with pytest.raises(ConfigError, match=r"expected an \.npz archive"):
        load_partition_file(one)


def test_pickled_arrays_are_refused(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "f.npz",
        train_idx_0=np.array([0, 1]),
        test_idx_0=np.array([2]),
        evil=np.array([{"a": 1}], dtype=object),
    )
    with pytest.raises(ConfigError, match="cannot read"):
        load_partition_file(path)


# ----- the command lines ------------------------------------------------------------------------
def test_coordinator_partition_writes_our_seeded_split(tmp_path: Path) -> None:
    from coordinator.cli import main
    from edge_agent.data import load_dataset, make_partition_spec

    out = tmp_path / "split.npz"
    args = ["partition", "--data", "digits", "--clients", "4", "--alpha", "0.3", "--seed", "1"]
    assert main([*args, "--global-test-size", "100", "--out", str(out)]) == 0
    ds = load_dataset("digits")
    spec = make_partition_spec("dirichlet:0.3", num_clients=4, seed=1, global_test_size=100)
    want = make_federated_split(ds, spec)
    got = split_from_file(ds, load_partition_file(out, num_clients=4))
    for k in range(4):
        np.testing.assert_array_equal(got.client_train_indices[k], want.client_train_indices[k])
        np.testing.assert_array_equal(got.client_test_indices[k], want.client_test_indices[k])
    np.testing.assert_array_equal(got.global_test_indices, want.global_test_indices)


def _agent_options(*extra: str) -> object:
    from edge_agent.cli import _options, build_parser
    from edge_agent.joining import Adopted

    args = build_parser().parse_args(["--broker", "localhost", *extra])
    return _options(args, "dev", Adopted("fedproto", (), 64))


def test_edge_agent_takes_its_client_from_the_file(tmp_path: Path) -> None:
    path = save_partition_file(tmp_path / "s.npz", make_federated_split(_dataset(), _spec()))
    opts = _agent_options("--partition-file", str(path), "--client", "3", "--clients", "5")
    assert opts.partition_file == path and opts.client_index == 3  # type: ignore[attr-defined]
    assert opts.partition is None  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="holds 5 clients"):
        _agent_options("--partition-file", str(path), "--client", "1", "--clients", "4")
    with pytest.raises(ConfigError, match=r"--client 5: .* holds clients 0\.\.4"):
        _agent_options("--partition-file", str(path), "--client", "5")


def test_edge_agent_split_knobs(tmp_path: Path) -> None:
    opts = _agent_options(
        "--partition", "dirichlet:0.1", "--clients", "20", "--client", "3",
        "--test-fraction", "0.25", "--min-size", "40", "--partition-seed", "1", "--eval-every", "5",
    )  # fmt: skip
    spec = opts.partition  # type: ignore[attr-defined]
    assert (spec.num_clients, spec.test_fraction, spec.min_size, spec.seed) == (20, 0.25, 40, 1)
    assert opts.client_index == 3  # type: ignore[attr-defined]
    assert opts.eval_every == 5  # type: ignore[attr-defined]


def test_edge_agent_refuses_a_split_without_its_shard(tmp_path: Path) -> None:
    """Devices started alike with a split but no --client would all train shard 0."""
    path = save_partition_file(tmp_path / "s.npz", make_federated_split(_dataset(), _spec()))
    with pytest.raises(ConfigError, match=r"--client: which of the 5 shards .* \(0\.\.4\)"):
        _agent_options("--partition-file", str(path))
    with pytest.raises(ConfigError, match=r"--client: which of the 4 shards"):
        _agent_options("--partition", "iid", "--clients", "4")
    with pytest.raises(ConfigError, match="needs --clients N"):
        _agent_options("--partition", "iid", "--client", "1")
    with pytest.raises(ConfigError, match=r"--client 7: the iid split holds clients 0\.\.3"):
        _agent_options("--partition", "iid", "--clients", "4", "--client", "7")
    with pytest.raises(ConfigError, match="--client 2: picks a shard"):
        _agent_options("--client", "2")
    assert _agent_options("--partition", "iid", "--clients", "1").client_index == 0  # type: ignore[attr-defined]
    assert _agent_options().client_index == 0  # type: ignore[attr-defined]
