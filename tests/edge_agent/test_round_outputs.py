"""What a round leaves: a test set the agent does not hold (an empty global test set) is left
out of the reply, never sent as NaN; a reply its own check refuses (a diverged model's NaN loss)
fails that task with its reason, and the agent takes the next."""

from __future__ import annotations

import dataclasses
import queue
from pathlib import Path

from edge_agent.agent import EdgeAgent
from edge_agent.trainer import TensorData
from protocol.contract.codec import Envelope
from protocol.contract.messages import ErrorReply, Reply, Task
from protocol.transport.base import MemoryBroker
from tests.helpers_runtime import device_uplink, memory_agent, train_task


def _agent(tmp_path: Path) -> tuple[queue.Queue[Envelope], EdgeAgent]:
    broker = MemoryBroker()
    seen = device_uplink(broker)
    return seen, memory_agent(tmp_path, broker)


def _answer(seen: queue.Queue[Envelope]) -> object:
    while True:
        body = seen.get(timeout=60).body
        if isinstance(body, Reply | ErrorReply):
            return body


def test_an_empty_global_test_set_is_left_out_of_the_reply(tmp_path: Path) -> None:
    # Prepare: an agent whose global test set holds no sample
    seen, agent = _agent(tmp_path)
    test = agent.ctx.test
    agent.ctx.global_test = TensorData(test.x[:0], test.y[:0])
    # Execute
    agent.dispatch(Envelope(body=train_task("fedproto", 1), sender="coordinator"))
    body = _answer(seen)
    # Assert: a reply with the local figures and no global ones
    assert isinstance(body, Reply), body
    assert "acc_local" in body.metrics
    assert "acc_global" not in body.metrics and "loss_global" not in body.metrics


def test_a_reply_its_own_check_refuses_fails_the_task_and_the_agent_lives_on(
    tmp_path: Path,
) -> None:
    # Prepare: a round whose loss diverged to NaN (a Reply refuses non-finite metrics)
    seen, agent = _agent(tmp_path)
    handle = agent.algorithm.handle

    def diverged(task: Task):  # type: ignore[no-untyped-def]
        result = handle(task)
        return dataclasses.replace(result, metrics={**result.metrics, "loss_train": float("nan")})

    agent.algorithm.handle = diverged  # type: ignore[method-assign]
    # Execute: the diverged round, then a healthy one
    agent.dispatch(Envelope(body=train_task("fedproto", 1), sender="coordinator"))
    first = _answer(seen)
    agent.algorithm.handle = handle  # type: ignore[method-assign]
    agent.dispatch(Envelope(body=train_task("fedproto", 2), sender="coordinator"))
    second = _answer(seen)
    # Assert: an error reply naming the check, then a reply
    assert isinstance(first, ErrorReply) and first.code == "ValidationError", first
    assert first.task_id == "t.1.0.agent0"
    assert isinstance(second, Reply) and second.round == 2
