"""An agent under ``hyper.dp``: its replies say the epsilon spent, its ledger survives a restart,
and once its budget is spent it stops contributing and says why; with DP off nothing changes."""

from __future__ import annotations

import dataclasses
import queue
from pathlib import Path

from coordinator.sim.simulate import agent_options
from edge_agent.class_stats import class_prototypes
from edge_agent.factory import build_agent
from protocol.algorithms import config_type
from protocol.contract.codec import Envelope, decode
from protocol.contract.messages import ErrorReply, Reply, Task
from protocol.contract.payloads import pack_payloads
from protocol.contract.topics import Topics
from protocol.transport.base import MemoryBroker, MemoryTransport
from tests.helpers_runtime import FLEET, run_config


def _task(n: int, **hyper: object) -> Task:
    cfg = config_type("fedproto")(local_epochs=1, **hyper)  # type: ignore[arg-type]
    return Task(
        task_id=f"t.{n}.0.agent0",
        run_id="t",
        round=n,
        phase="train",
        deadline=1e12,
        algorithm="fedproto",
        config=cfg.task_config(),
    )


def _agent(tmp_path: Path, broker: MemoryBroker):
    opts = agent_options(run_config(tmp_path), FLEET, 0)
    opts = dataclasses.replace(opts, state_dir=tmp_path / "agent0")
    transport = MemoryTransport(broker, opts.device_id)
    agent = build_agent(opts, transport)
    agent.start()
    transport.connect()
    return agent


def _answers(broker: MemoryBroker) -> queue.Queue[Envelope]:
    seen: queue.Queue[Envelope] = queue.Queue()
    coord = MemoryTransport(broker, "coordinator")
    coord.connect()
    coord.subscribe(f"{Topics().base}/dev/+/up/#", lambda _t, data: seen.put(decode(data)))
    return seen


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
