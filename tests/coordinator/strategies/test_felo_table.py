"""Felo/Velo's knowledge table under each window (spec §8-D3), against hand-computed means."""

import numpy as np
import pytest

from coordinator.strategies.felo.table import KnowledgeTable
from protocol.contract.payloads import FeatureLogitSet
from protocol.errors import ValidationError

C = 3


def upload(classes: list[int], value: float, counts: list[int] | None = None) -> FeatureLogitSet:
    m = len(classes)
    return FeatureLogitSet(
        np.array(classes, np.int32),
        np.full((m, 2), value, np.float32),
        np.full((m, C), -value, np.float32),
        np.array(counts or [1] * m, np.int32),
    )


def test_history_averages_every_entry_and_keeps_the_newest_cap_per_class() -> None:
    # Prepare
    t = KnowledgeTable(C, "history_fifo", cap=2)
    # Execute
    t.add(1, [("a", upload([0, 1], 1.0)), ("b", upload([0], 3.0))])
    t.add(2, [("a", upload([0], 8.0))])
    means = t.means()
    # Assert: class 0 keeps its two newest entries (3, 8); class 1 its only one; class 2 none
    assert means is not None
    assert means.class_ids.tolist() == [0, 1]
    np.testing.assert_allclose(means.features[:, 0], [5.5, 1.0])
    np.testing.assert_allclose(means.logits[:, 0], [-5.5, -1.0])


def test_latest_per_client_overwrites_a_clients_older_entry() -> None:
    t = KnowledgeTable(C, "latest_per_client")
    t.add(1, [("a", upload([0], 1.0)), ("b", upload([0], 3.0))])
    t.add(2, [("a", upload([0], 5.0))])
    means = t.means()
    assert means is not None
    np.testing.assert_allclose(means.features[0], [4.0, 4.0])  # mean of a's 5 and b's 3
    assert len(t) == 2


def test_current_round_keeps_only_the_last_round() -> None:
    t = KnowledgeTable(C, "current_round")
    t.add(1, [("a", upload([0, 2], 1.0))])
    t.add(2, [("b", upload([0], 7.0))])
    means = t.means()
    assert means is not None
    assert means.class_ids.tolist() == [0]  # class 2 was only reported in round 1
    np.testing.assert_allclose(means.features[0], [7.0, 7.0])


def test_count_weighted_means_weight_entries_by_samples() -> None:
    t = KnowledgeTable(C, count_weighted=True)
    t.add(1, [("a", upload([1], 1.0, [3])), ("b", upload([1], 5.0, [1]))])
    means = t.means()
    assert means is not None
    np.testing.assert_allclose(means.features[0], [2.0, 2.0])  # (3*1 + 1*5) / 4
    assert means.counts.tolist() == [4]


def test_a_bound_in_rounds_drops_older_entries_under_any_window() -> None:
    t = KnowledgeTable(C, count_weighted=True, rounds=2)
    t.add(1, [("a", upload([0], 100.0, [50]))])
    t.add(2, [("a", upload([0], 1.0, [3]))])
    t.add(3, [("b", upload([0], 5.0, [1]))])
    means = t.means()
    assert means is not None  # round 1's heavy entry is 3 rounds old at round 3: gone
    np.testing.assert_allclose(means.features[0], [2.0, 2.0])  # (3*1 + 1*5) / 4
    assert t.round.tolist() == [2, 3]


def test_empty_table_has_no_knowledge_and_round_trips() -> None:
    t = KnowledgeTable(C)
    assert t.means() is None
    t.add(1, [("a", upload([], 0.0))])
    assert t.means() is None
    t.add(2, [("a", upload([2], 2.0))])
    restored = KnowledgeTable(C)
    restored.load_tensormap(t.to_tensormap())
    a, b = t.means(), restored.means()
    assert a is not None and b is not None
    np.testing.assert_array_equal(a.features, b.features)
    np.testing.assert_array_equal(a.logits, b.logits)


def test_a_feature_dimension_other_than_the_tables_is_refused() -> None:
    t = KnowledgeTable(C)
    t.add(1, [("a", upload([0], 1.0))])
    bad = FeatureLogitSet(np.array([1]), np.zeros((1, 5)), np.zeros((1, C)), np.array([1]))
    with pytest.raises(ValidationError, match="dimension 2"):
        t.add(2, [("b", bad)])
    assert len(t) == 1  # nothing half-added


def test_a_stale_entry_weighs_its_staleness_weight_in_the_means() -> None:
    t = KnowledgeTable(C, count_weighted=True)
    # b answers a task of round 1, folded in round 3 with staleness weight 0.25
    t.add(
        3,
        [("a", upload([1], 1.0, [3])), ("b", upload([1], 5.0, [2]))],
        dated=[3, 1],
        weights=[1.0, 0.25],
    )
    means = t.means()
    assert means is not None
    expected = (3 * 1.0 + 0.25 * 2 * 5.0) / (3 + 0.25 * 2)
    np.testing.assert_allclose(means.features[0], [expected] * 2, rtol=1e-6)
    np.testing.assert_allclose(means.logits[0], [-expected] * C, rtol=1e-6)
    assert means.counts.tolist() == [5]  # the samples behind the class, not weighted
    assert t.round.tolist() == [3, 1]  # dated by the task, not by the fold


def test_the_window_in_rounds_counts_from_the_task_a_stale_entry_answers() -> None:
    t = KnowledgeTable(C, rounds=2)
    # folded in round 4: a's task is of round 3 (kept), b's of round 2 (two rounds old: gone)
    t.add(4, [("a", upload([0], 1.0)), ("b", upload([0], 9.0))], dated=[3, 2])
    assert t.round.tolist() == [3]
    means = t.means()
    assert means is not None
    np.testing.assert_allclose(means.features[0], [1.0, 1.0])


def test_latest_per_client_keeps_the_entry_of_the_latest_task_not_the_latest_fold() -> None:
    t = KnowledgeTable(C, "latest_per_client")
    t.add(3, [("a", upload([0], 1.0))])
    t.add(4, [("a", upload([0], 7.0))], dated=[2], weights=[0.5])  # an older task, folded later
    assert t.round.tolist() == [3]
    means = t.means()
    assert means is not None
    np.testing.assert_allclose(means.features[0], [1.0, 1.0])


def test_history_drops_the_entries_of_the_oldest_tasks_first() -> None:
    t = KnowledgeTable(C, "history_fifo", cap=2)
    t.add(3, [("a", upload([0], 1.0)), ("b", upload([0], 2.0))])
    t.add(4, [("c", upload([0], 5.0))], dated=[1], weights=[0.5])  # older than both
    assert sorted(t.round.tolist()) == [3, 3]


def test_current_round_keeps_the_last_folds_entries_stale_ones_weighted() -> None:
    t = KnowledgeTable(C, "current_round")
    t.add(1, [("a", upload([0], 1.0))])
    t.add(2, [("b", upload([0], 2.0)), ("c", upload([0], 8.0))], dated=[2, 1], weights=[1, 0.5])
    means = t.means()
    assert means is not None
    expected = (2.0 + 0.5 * 8.0) / 1.5
    np.testing.assert_allclose(means.features[0], [expected] * 2, rtol=1e-6)


def test_staleness_weights_survive_a_restart() -> None:
    t = KnowledgeTable(C)
    t.add(2, [("a", upload([0], 1.0)), ("b", upload([0], 4.0))], dated=[2, 1], weights=[1, 0.3])
    restored = KnowledgeTable(C)
    restored.load_tensormap(t.to_tensormap())
    a, b = t.means(), restored.means()
    assert a is not None and b is not None
    np.testing.assert_array_equal(a.features, b.features)
    np.testing.assert_array_equal(restored.round, [2, 1])
