"""An agent under ``hyper.dp``: its replies say the epsilon spent, its ledger survives a restart,
and once its budget is spent it stops contributing and says why; where the run reads the label
histogram it registers it noised, once, charged to the budget; with DP off nothing changes."""

from __future__ import annotations

import queue
from pathlib import Path

import pytest

from edge_agent.class_stats import class_prototypes
from edge_agent.dp import PrivacyLedger, noise_multiplier
from protocol.contract.codec import Envelope
from protocol.contract.messages import CoordinatorState, ErrorReply, Register, Reply, Task
from protocol.contract.payloads import pack_payloads
from protocol.transport.base import MemoryBroker
from tests.helpers_runtime import device_uplink, memory_agent, train_task


def _task(n: int, algorithm: str = "fedproto", **hyper: object) -> Task:
    return train_task(algorithm, n, **hyper)


def _agent(tmp_path: Path, broker: MemoryBroker, algorithm: str = "fedproto", **settings: object):
    return memory_agent(tmp_path, broker, algorithm, **settings)


_answers = device_uplink


def _next(seen: queue.Queue[Envelope], kind: type) -> object:
    while True:
        env = seen.get(timeout=60)
        if isinstance(env.body, kind):
            return env.body


def test_a_device_reports_its_epsilon_and_stops_when_its_budget_is_spent(tmp_path: Path) -> None:
    # Prepare: a budget of epsilon 2 for one release
    broker = MemoryBroker()
    seen = _answers(broker)
    agent = _agent(tmp_path, broker)
    dp = {"dp_epsilon": 2.0, "dp_clip": 1.0, "dp_releases": 1}
    # Execute: round 1 releases, round 2 would exceed the budget; then a restart
    agent.dispatch(Envelope(body=_task(1, **dp), sender="coordinator"))
    first = _next(seen, Reply)
    agent.dispatch(Envelope(body=_task(2, **dp), sender="coordinator"))
    refusal = _next(seen, ErrorReply)
    restarted = _agent(tmp_path, broker)
    restarted.dispatch(Envelope(body=_task(3, **dp), sender="coordinator"))
    again = _next(seen, ErrorReply)
    # Assert
    assert isinstance(first, Reply)
    assert abs(first.metrics["dp_epsilon"] - 2.0) < 1e-3
    assert first.metrics["dp_epsilon_round"] == first.metrics["dp_epsilon"]
    for error in (refusal, again):
        assert isinstance(error, ErrorReply) and error.code == "PrivacyBudgetError"
        assert "privacy budget spent: 1 releases" in error.reason and "no more" in error.reason


def test_with_dp_off_the_task_and_the_reply_are_what_they_were(tmp_path: Path) -> None:
    # Prepare
    broker = MemoryBroker()
    seen = _answers(broker)
    agent = _agent(tmp_path, broker)
    task = _task(1)
    # Execute
    agent.dispatch(Envelope(body=task, sender="coordinator"))
    reply = _next(seen, Reply)
    # Assert: no dp key travels; the prototypes are the plain class means' bytes
    assert not [k for k in task.config if k.startswith("dp_")]
    assert isinstance(reply, Reply) and not [k for k in reply.metrics if k.startswith("dp_")]
    ctx = agent.ctx
    plain = class_prototypes(ctx.model, ctx.train, ctx.num_classes)
    assert pack_payloads(reply.payloads) == pack_payloads({"protos": plain})


def _state(state: str = "starting", **dp: float) -> Envelope:
    body = CoordinatorState(
        state=state,
        run_id="t",
        algorithm="fd",
        round=0,
        total_rounds=2,
        **dp,  # type: ignore[arg-type]
    )
    return Envelope(body=body, sender="coordinator")


def test_a_run_that_reads_the_histogram_under_dp_gets_it_noised_once_and_charged(
    tmp_path: Path,
) -> None:
    # Prepare: an FD device waiting for the run's state, which announces a budget of 2 for 2
    # releases; a device of the same data in a run without DP
    broker = MemoryBroker()
    seen = _answers(broker)
    agent = _agent(tmp_path, broker, "fd", class_counts=None)
    budget = {"dp_epsilon": 2.0, "dp_delta": 1e-5, "dp_releases": 2}
    # Execute: register, register again for a restarted coordinator, then restart the device
    # (a fresh process on the same state directory) and train a round
    agent.dispatch(_state(**budget))
    first = _next(seen, Register)
    agent.dispatch(_state(**budget))
    second = _next(seen, Register)
    restarted = _agent(tmp_path, broker, "fd", class_counts=None)
    restarted.dispatch(_state(**budget))
    third = _next(seen, Register)
    task = _task(1, "fd", dp_epsilon=2.0, dp_releases=2)
    restarted.dispatch(Envelope(body=task, sender="coordinator"))
    reply = _next(seen, Reply)
    plain = _agent(tmp_path / "plain", broker, "fd", class_counts=None)
    plain.dispatch(_state())
    exact = _next(seen, Register)
    # Assert: the noised histogram differs from the true one, is the same in every
    # registration, and its release is one more mechanism of the one z, in the ledger
    true = {str(c): n for c, n in enumerate(agent.ctx.class_counts) if n > 0}
    assert isinstance(first, Register) and isinstance(exact, Register)
    assert exact.class_counts == true and first.class_counts != true
    assert set(first.class_counts) == set(true)  # the class set, as every form discloses it
    assert isinstance(second, Register) and isinstance(third, Register)
    assert second.class_counts == third.class_counts == first.class_counts
    z = noise_multiplier(2.0, 1e-5, 2, 2, 1)
    assert restarted.ctx.privacy.events == [(z, 1, 1.0), (z, 2, 1.0)]
    assert isinstance(reply, Reply)
    registration = reply.metrics["dp_epsilon"] - reply.metrics["dp_epsilon_round"]
    assert registration == pytest.approx(PrivacyLedger().epsilon(1e-5, (z, 1, 1.0)))
    assert reply.num_samples == sum(first.class_counts.values())  # the coordinator's bound
    logits = reply.payloads["logits"]
    bound = {int(c): n for c, n in first.class_counts.items()}
    released = zip(logits.class_ids.tolist(), logits.counts.tolist(), strict=True)
    assert all(n <= bound[c] for c, n in released)


def test_released_counts_are_capped_by_public_bounds_never_the_true_histogram(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: FedProto registers the class set and total only; spy on what caps its counts
    from edge_agent.algorithms import base

    caps: list[list[int]] = []
    real = base.privatize

    def spy(stats, held, *args):  # type: ignore[no-untyped-def]
        caps.append(list(held))
        return real(stats, held, *args)

    monkeypatch.setattr(base, "privatize", spy)
    broker = MemoryBroker()
    seen = _answers(broker)
    agent = _agent(tmp_path, broker)
    # Execute
    agent.dispatch(Envelope(body=_task(1, dp_epsilon=8.0, dp_releases=4), sender="coordinator"))
    reply = _next(seen, Reply)
    # Assert: each held class is capped at the device's total (public), not at its own count
    counts = agent.ctx.class_counts
    assert isinstance(reply, Reply) and len(caps) == 1
    assert caps[0] == [sum(counts) if n > 0 else 0 for n in counts]
    assert caps[0] != list(counts)
