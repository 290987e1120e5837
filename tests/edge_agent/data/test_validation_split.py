"""A device's validation split: part of its training data only, seeded, class-stratified."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.data import load_dataset, make_federated_split, make_partition_spec
from edge_agent.data.validation import validation_indices, validation_seed


def test_it_is_a_stratified_share_of_the_training_data_and_the_rest_trains() -> None:
    labels = np.array([0] * 100 + [1] * 50 + [2] * 10, dtype=np.int64)
    train, held = validation_indices(labels, 0.2, seed=7)
    assert not set(train) & set(held)
    assert sorted([*train, *held]) == list(range(len(labels)))
    assert np.bincount(labels[held], minlength=3).tolist() == [20, 10, 2]


def test_every_class_keeps_a_training_sample() -> None:
    labels = np.array([0] * 20 + [1], dtype=np.int64)  # class 1 held once
    train, held = validation_indices(labels, 0.5, seed=0)
    assert 20 in train and 20 not in held
    assert len(held) == 11  # round(0.5 x 21), all of class 0: class 1 cannot give its one


def test_the_same_seed_holds_out_the_same_samples_and_another_seed_others() -> None:
    labels = np.repeat(np.arange(10, dtype=np.int64), 30)
    first = validation_indices(labels, 0.25, seed=validation_seed("agent0"))
    again = validation_indices(labels, 0.25, seed=validation_seed("agent0"))
    other = validation_indices(labels, 0.25, seed=validation_seed("agent1"))
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not np.array_equal(first[1], other[1])


def test_a_fraction_of_zero_holds_out_nothing_and_one_is_refused() -> None:
    labels = np.arange(10, dtype=np.int64) % 2
    train, held = validation_indices(labels, 0.0, seed=0)
    assert len(held) == 0 and len(train) == 10
    with pytest.raises(ValueError, match="validation fraction"):
        validation_indices(labels, 1.0, seed=0)


def test_on_a_federated_split_it_never_touches_the_test_splits() -> None:
    dataset = load_dataset("digits")
    spec = make_partition_spec("dirichlet:1.0", num_clients=3, seed=0, global_test_size=200)
    split = make_federated_split(dataset, spec)
    for k in range(split.num_clients):
        client_train = split.client_train_indices[k]
        train, held = validation_indices(dataset.y[client_train], 0.2, seed=k)
        held_samples = set(client_train[held])
        assert held_samples and held_samples <= set(client_train)
        assert not held_samples & set(client_train[train])
        assert not held_samples & set(split.client_test_indices[k])
        assert not held_samples & set(split.global_test_indices)
