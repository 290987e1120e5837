"""Seeded partitions: coverage, determinism, skew, min_size and the pathological class count."""

from __future__ import annotations

from typing import get_args

import numpy as np
import pytest

from edge_agent.data import SCHEMES, Scheme, partition
from protocol.errors import ConfigError

LABELS = np.repeat(np.arange(10), 150)  # 1500 samples, 10 balanced classes
ALL_SCHEMES: list[Scheme] = ["iid", "dirichlet", "pathological"]


def _entropy(labels: np.ndarray, num_classes: int = 10) -> float:
    p = np.bincount(labels, minlength=num_classes) / len(labels)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def test_registry_matches_the_scheme_literal() -> None:
    assert set(SCHEMES) == set(get_args(Scheme))


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
@pytest.mark.parametrize("num_clients", [1, 7, 10])
def test_every_index_used_exactly_once(scheme: Scheme, num_clients: int) -> None:
    parts = partition(
        LABELS, num_clients, scheme=scheme, seed=3, classes_per_client=2 if num_clients > 4 else 10
    )
    assert len(parts) == num_clients
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in parts)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(LABELS)))


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_same_seed_same_partition_other_seed_differs(scheme: Scheme) -> None:
    a = partition(LABELS, 6, scheme=scheme, seed=1)
    b = partition(LABELS, 6, scheme=scheme, seed=1)
    c = partition(LABELS, 6, scheme=scheme, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_dirichlet_skew_grows_as_alpha_shrinks() -> None:
    def mean_entropy(alpha: float) -> float:
        vals = [
            _entropy(LABELS[p])
            for seed in range(3)
            for p in partition(LABELS, 10, scheme="dirichlet", alpha=alpha, seed=seed)
        ]
        return float(np.mean(vals))

    strong, medium, weak = mean_entropy(0.1), mean_entropy(1.0), mean_entropy(10.0)
    assert strong < medium < weak
    assert strong < 0.6 * np.log(10) < weak  # far from uniform vs close to it


@pytest.mark.parametrize("alpha", [0.1, 0.5])
def test_dirichlet_honours_min_size(alpha: float) -> None:
    for seed in range(3):
        parts = partition(LABELS, 10, scheme="dirichlet", alpha=alpha, seed=seed, min_size=40)
        assert min(len(p) for p in parts) >= 40


def test_unreachable_min_size_gives_up_with_a_clear_error() -> None:
    labels = np.repeat(np.arange(2), 50)  # tiny alpha: each class lands on one client
    with pytest.raises(ConfigError, match="in 1000 draws"):
        partition(labels, 10, scheme="dirichlet", alpha=0.001, min_size=10)


def test_impossible_min_size_fails_before_drawing() -> None:
    with pytest.raises(ConfigError, match="cannot give 11 clients at least 150"):
        partition(LABELS, 11, scheme="iid", min_size=150)


@pytest.mark.parametrize(("num_clients", "k"), [(10, 2), (7, 3), (5, 2), (3, 10), (12, 1)])
def test_pathological_gives_exactly_k_classes(num_clients: int, k: int) -> None:
    parts = partition(LABELS, num_clients, scheme="pathological", classes_per_client=k, min_size=1)
    assert [len(np.unique(LABELS[p])) for p in parts] == [k] * num_clients


@pytest.mark.parametrize(
    ("num_clients", "k", "message"),
    [(5, 11, "only 10 classes"), (4, 2, "cannot cover all 10 classes")],
)
def test_pathological_rejects_impossible_layouts(num_clients: int, k: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        partition(LABELS, num_clients, scheme="pathological", classes_per_client=k)


def test_iid_sizes_differ_by_at_most_one() -> None:
    sizes = [len(p) for p in partition(LABELS, 7, scheme="iid")]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(
    ("labels", "kwargs", "message"),
    [
        (LABELS, {"scheme": "shards"}, "unknown partition scheme 'shards'"),
        (LABELS, {"scheme": "dirichlet", "alpha": 0.0}, "alpha must be a finite number > 0"),
        (LABELS, {"scheme": "iid", "num_clients": 0}, "num_clients must be an int >= 1"),
        (LABELS, {"scheme": "iid", "min_size": -1}, "min_size must be an int >= 0"),
        (LABELS.reshape(10, -1), {"scheme": "iid"}, "1-D integer array"),
        (LABELS.astype(float), {"scheme": "iid"}, "1-D integer array"),
        (LABELS - 1, {"scheme": "iid"}, "labels must be >= 0"),
    ],
)
def test_bad_arguments(labels: np.ndarray, kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"num_clients": 5, **kwargs}
    with pytest.raises(ConfigError, match=message):
        partition(labels, **args)  # type: ignore[arg-type]
