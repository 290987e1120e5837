"""``task_inputs_digest``: the attempts of one step share it; any input changes it."""

from __future__ import annotations

import dataclasses

import numpy as np

from protocol.contract.messages import Task, task_inputs_digest
from protocol.contract.payloads import PrototypeSet


def _task(**changes: object) -> Task:
    protos = PrototypeSet(np.array([0, 2]), np.ones((2, 4), np.float32), np.array([3, 5]))
    base = Task(
        task_id="run.4.0.dev1",
        run_id="run",
        round=3,
        phase="train",
        deadline=100.0,
        algorithm="fedproto",
        config={"lr": 0.01, "local_epochs": 1},
        payloads={"protos": protos},
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_the_id_and_the_deadline_do_not_enter() -> None:
    retry = _task(task_id="run.4.1.dev1", deadline=350.0)
    assert task_inputs_digest(retry) == task_inputs_digest(_task())


def test_config_order_does_not_matter() -> None:
    assert task_inputs_digest(_task(config={"local_epochs": 1, "lr": 0.01})) == (
        task_inputs_digest(_task())
    )


def test_every_input_changes_it() -> None:
    other = PrototypeSet(np.array([0, 2]), np.ones((2, 4), np.float32) * 2, np.array([3, 5]))
    changed = [
        _task(run_id="run2"),
        _task(round=4),
        _task(phase="final"),
        _task(algorithm="fedtgp"),
        _task(config={"lr": 0.02, "local_epochs": 1}),
        _task(payloads={"protos": other}),
        _task(payloads={}),
    ]
    digests = {task_inputs_digest(t) for t in changed}
    assert len(digests) == len(changed) and task_inputs_digest(_task()) not in digests
