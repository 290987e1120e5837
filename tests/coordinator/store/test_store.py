"""The SQLite store: durable updates, atomic step completion, resume."""

import json
from pathlib import Path

import numpy as np

from coordinator.store.database import StepRecord, Store, pack_payloads, unpack_payloads
from protocol.contract.payloads import PrototypeSet, TensorMap


def test_update_is_stored_once_and_survives_reopen(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    store.open_step(StepRecord(0, 1, "train", ["a", "b"], "open", 0))
    assert store.add_update(0, "a", "m1", "t1", b"env")
    assert not store.add_update(0, "a", "m2", "t1", b"env2")  # one update per device and step
    store.close()
    again = Store(tmp_path / "s.sqlite")
    assert [u[:2] for u in again.updates(0)] == [("a", "m1")]
    assert again.has_update_msg("m1") and not again.has_update_msg("m2")
    rec = again.step(0)
    assert rec is not None and rec.status == "open" and rec.participants == ["a", "b"]
    assert again.last_done_step() == -1


def test_a_batch_of_updates_is_stored_once_and_looked_up_in_one_query(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    store.open_step(StepRecord(0, 1, "train", ["a", "b"], "open", 0))
    store.add_update(0, "a", "m1", "t1", b"env")
    store.add_updates([(0, "b", "m2", "t2", b"env2"), (0, "a", "m3", "t1", b"again")])
    assert [u[:2] for u in store.updates(0)] == [("a", "m1"), ("b", "m2")]  # a's second ignored
    assert store.stored_msgs(["m1", "m2", "m3", "nope"]) == {"m1", "m2"}
    assert store.stored_msgs([]) == set()
    assert store.has_update_msg("m2") and not store.has_update_msg("m3")


def test_a_workers_batch_is_stored_only_while_its_step_is_open(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    store.open_step(StepRecord(0, 1, "train", ["a", "b", "c"], "open", 0))
    intake = {"step": 0, "attempt": 0, "round": 1, "phase": "train"}
    store.set_intake(intake)
    store.add_update(0, "a", "m1", "t1", b"env")
    rows = [("a", "m2", "t1", b"x"), ("b", "m3", "t2", b"y"), ("b", "m4", "t2", b"z")]
    staged = store.stage_updates(0, rows)  # a worker writes the bytes before the write lock

    stored = store.add_updates_if_open(intake, staged)

    assert stored == {"m3"}  # a had one already; b's first of the batch
    assert store.updates(0) == [("a", "m1", b"env"), ("b", "m3", b"y")]
    store.set_intake(None)  # the leader closed the step
    late = store.stage_updates(0, [("c", "m5", "t3", b"w")])
    assert store.add_updates_if_open(intake, late) is None
    assert [u[0] for u in store.updates(0)] == ["a", "b"]


def test_complete_step_persists_state_and_metrics(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    store.open_step(StepRecord(0, 1, "train", ["a"], "open", 0))
    state = {
        "protos": PrototypeSet(np.array([1]), np.ones((1, 3)), np.array([2]), sd=np.ones(3)),
        "w": TensorMap({"x": np.arange(4.0)}),
    }
    store.complete_step(0, "done", state, json.dumps({"round": 1}))
    assert store.last_done_step() == 0
    back = store.global_state()
    assert isinstance(back["protos"], PrototypeSet) and back["protos"].class_ids.tolist() == [1]
    assert store.metrics() == [{"round": 1}]


def test_payload_blob_round_trip() -> None:
    blob = pack_payloads({"w": TensorMap({"a": np.ones((2, 2), np.float32)}, encoding="f16")})
    out = unpack_payloads(blob)["w"]
    assert isinstance(out, TensorMap) and out.tensors["a"].dtype == np.float32


def test_worker_traffic_adds_up_per_step_and_key_across_workers(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    with store.transaction():
        store.add_worker_traffic(1, {"rx.reply": 100, "tx.ack": 10})
    with store.transaction():  # another worker, another batch of the same step
        store.add_worker_traffic(1, {"rx.reply": 50, "tx.ack": 0})
        store.add_worker_traffic(2, {"rx.reply": 7})
    assert store.worker_traffic(1) == {"rx.reply": 150, "tx.ack": 10}
    assert store.worker_traffic(2) == {"rx.reply": 7}
    assert store.worker_traffic(3) == {}
    store.close()


def test_a_burst_of_registrations_is_stored_in_one_statement_and_replaces_older_ones(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "s.sqlite")
    store.upsert_agent("d1", b"old", online=False)
    with store.transaction():
        store.upsert_agents({"d1": b"new", "d2": b"reg2"})
    store.close()
    rows = Store(tmp_path / "s.sqlite").agent_rows()
    assert sorted((d, reg, online) for d, reg, online, _seen in rows) == [
        ("d1", b"new", True),
        ("d2", b"reg2", True),
    ]


def test_updates_but_those_the_leader_holds_come_in_device_order(tmp_path: Path) -> None:
    # 1,203 devices: more than one "IN (...)" batch of the ones still to read
    store = Store(tmp_path / "s.sqlite")
    devices = [f"d{i:04d}" for i in range(1203)]
    store.open_step(StepRecord(0, 1, "train", devices, "open", 0))
    store.add_updates([(0, d, f"m{d}", "t", d.encode()) for d in reversed(devices)])
    store.add_updates([(1, "d0001", "other", "t", b"x")])  # another step's: never read
    held = {d: None for d in devices[::3]}
    rows = store.updates(0, skip=held)
    assert rows == [(d, f"m{d}", d.encode()) for d in devices if d not in held]
    assert store.updates(0, skip={}) == store.updates(0) != rows
