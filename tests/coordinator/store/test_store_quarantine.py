"""A step whose aggregation failed: closed for good, its updates quarantined, not replayed."""

import json
from pathlib import Path

from coordinator.store.database import StepRecord, Store


def test_failed_aggregation_quarantines_updates_and_closes_the_step(tmp_path: Path) -> None:
    # Prepare: step 0 done, step 1 with two stored updates
    store = Store(tmp_path / "s.sqlite")
    store.open_step(StepRecord(0, 1, "train", ["a", "b"], "open", 0))
    store.complete_step(0, "done", {}, json.dumps({"round": 1}))
    store.open_step(StepRecord(1, 2, "train", ["a", "b"], "open", 0))
    store.add_update(1, "a", "m1", "t1", b"env-a")
    store.add_update(1, "b", "m2", "t2", b"env-b")
    # Execute
    store.fail_step(1, json.dumps({"round": 2, "status": "failed"}), "shapes differ")
    store.close()
    again = Store(tmp_path / "s.sqlite")
    # Assert
    rec = again.step(1)
    assert rec is not None and rec.status == "failed"
    assert again.updates(1) == []
    assert again.quarantined(1) == [("a", "m1", "shapes differ"), ("b", "m2", "shapes differ")]
    assert again.has_update_msg("m1")  # a resent reply is acknowledged as a duplicate
    assert again.stored_msgs(["m1", "m2", "m3"]) == {"m1", "m2"}  # the batch lookup too
    assert again.last_closed_step() == 1 and again.last_done_step() == 0
    assert [m["round"] for m in again.metrics()] == [1, 2]


def test_a_step_that_missed_quorum_is_not_closed_for_good(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    store.open_step(StepRecord(0, 1, "train", ["a"], "open", 0))
    store.complete_step(0, "failed", {}, json.dumps({"round": 1, "quorum_met": False}))
    assert store.last_closed_step() == -1  # a restart retries it
