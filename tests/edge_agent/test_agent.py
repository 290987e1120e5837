"""The edge agent: durable outbox, duplicate tasks, acknowledgements, restart and resume."""

from __future__ import annotations

import queue
from pathlib import Path

import numpy as np
import pytest
import torch

from coordinator.sim.simulate import agent_options
from edge_agent.agent import EdgeAgent
from edge_agent.factory import build_agent
from protocol.algorithms import config_type
from protocol.contract.codec import Envelope, decode
from protocol.contract.messages import Ack, ErrorReply, Register, Reply, Task
from protocol.contract.payloads import PrototypeSet
from protocol.contract.topics import Topics
from protocol.transport.base import MemoryBroker, MemoryTransport
from tests.helpers_runtime import FLEET, memory_agent, run_config, train_task


class FakeCoordinator:
    """Records what the agent sends up."""

    def __init__(self, broker: MemoryBroker) -> None:
        self.transport = MemoryTransport(broker, "coordinator")
        self.transport.connect()
        self.inbox: queue.Queue[Envelope] = queue.Queue()
        # raw frames, not an Endpoint: a resent reply keeps its message id, which an Endpoint
        # would (rightly) drop as a duplicate
        self.transport.subscribe(
            f"{Topics().base}/dev/+/up/#", lambda t, data: self.inbox.put(decode(data))
        )

    def next(self, kind: type) -> Envelope:
        while True:
            env = self.inbox.get(timeout=30)
            if isinstance(env.body, kind):
                return env


def make(tmp_path: Path, broker: MemoryBroker):
    cfg = run_config(tmp_path)
    opts = agent_options(cfg, FLEET, 0)
    transport = MemoryTransport(broker, opts.device_id)
    agent = build_agent(opts, transport)
    transport.connect()
    return agent


def task(task_id: str = "run.0.0.agent0", payloads: dict | None = None) -> Task:
    cfg = config_type("fedproto")(local_epochs=1).to_dict()
    return Task(
        task_id=task_id,
        run_id="run",
        round=1,
        phase="train",
        deadline=1e12,
        algorithm="fedproto",
        config=cfg,
        payloads=payloads or {},
    )


def test_task_reply_outbox_and_ack(tmp_path: Path) -> None:
    # Prepare
    broker = MemoryBroker()
    coord = FakeCoordinator(broker)
    agent = make(tmp_path, broker)
    agent.start()
    reg = coord.next(Register).body
    assert isinstance(reg, Register) and reg.algorithm == "fedproto"
    held = reg.present_classes()
    # Execute
    agent.dispatch(Envelope(body=task(), sender="coordinator"))
    env = coord.next(Reply)
    # Assert: prototypes of exactly the held classes, metrics, a pending outbox entry
    reply = env.body
    assert isinstance(reply, Reply)
    protos = reply.payloads["protos"]
    assert isinstance(protos, PrototypeSet) and protos.class_ids.tolist() == held
    assert protos.dim == 16 and 0.0 <= reply.metrics["acc_global"] <= 1.0
    assert [e.msg_id for _, e in agent.state.pending()] == [env.msg_id]
    # the same task again (e.g. re-sent after a coordinator restart): same reply, no retraining
    agent.dispatch(Envelope(body=task(), sender="coordinator"))
    assert coord.next(Reply).msg_id == env.msg_id
    agent.dispatch(Envelope(body=Ack(ref_id=env.msg_id), sender="coordinator"))
    assert agent.state.pending() == []


def test_restart_resends_unacknowledged_reply_and_restores_model(tmp_path: Path) -> None:
    broker = MemoryBroker()
    coord = FakeCoordinator(broker)
    agent = make(tmp_path, broker)
    agent.start()
    agent.dispatch(Envelope(body=task(), sender="coordinator"))
    sent = coord.next(Reply)
    weights = {k: v.clone() for k, v in agent.ctx.model.state_dict().items()}
    agent.endpoint.transport.close()
    # Execute: a fresh process on the same state directory
    again = make(tmp_path, broker)
    again.start()
    # Assert: the reply is resent with its message id, and the trained weights are back
    assert coord.next(Reply).msg_id == sent.msg_id
    for k, v in again.ctx.model.state_dict().items():
        assert np.allclose(v.cpu().numpy(), weights[k].cpu().numpy())


def test_bad_payload_gives_error_reply_not_a_crash(tmp_path: Path) -> None:
    broker = MemoryBroker()
    coord = FakeCoordinator(broker)
    agent = make(tmp_path, broker)
    agent.start()
    wrong_dim = PrototypeSet(np.array([0]), np.ones((1, 5), np.float32), np.array([3]))
    agent.dispatch(Envelope(body=task(payloads={"protos": wrong_dim}), sender="coordinator"))
    err = coord.next(ErrorReply).body
    assert isinstance(err, ErrorReply) and "dim 16" in err.reason
    assert agent.state.pending() == []
    # the agent keeps working afterwards
    agent.dispatch(Envelope(body=task("run.1.0.agent0"), sender="coordinator"))
    assert isinstance(coord.next(Reply).body, Reply)


def test_a_repeated_running_state_does_not_register_again_and_a_lost_session_is_renewed(
    tmp_path: Path,
) -> None:
    # registering again on `running` would make the coordinator resend round 1's task
    from protocol.contract.messages import CoordinatorState

    def state(kind: str, run_id: str = "r1") -> CoordinatorState:
        return CoordinatorState(  # FedProto's: agents register only their class set
            state=kind,
            run_id=run_id,
            algorithm="fedproto",
            round=1,
            total_rounds=2,
            class_counts=False,
        )

    broker = MemoryBroker()
    coord = FakeCoordinator(broker)
    agent = make(tmp_path, broker)
    agent.start()
    first = coord.next(Register).body
    registers = [first]

    def drain() -> None:
        while not coord.inbox.empty():
            env = coord.inbox.get()
            if isinstance(env.body, Register):
                registers.append(env.body)

    # Execute + Assert: found running on connect, starting -> running, a repeat: none again
    agent.on_coordinator_state(state("running"))
    drain()
    assert len(registers) == 1
    agent.on_coordinator_state(state("starting"))  # a coordinator (re)starting: register
    agent.on_coordinator_state(state("running"))
    agent.on_coordinator_state(state("running"))
    drain()
    assert len(registers) == 2
    agent.on_coordinator_state(state("offline"))  # it vanished; a new one may not know us
    agent.on_coordinator_state(state("running"))
    agent.on_coordinator_state(state("running", "r2"))  # another run
    drain()
    assert len(registers) == 4
    assert {r.session for r in registers} == {first.session} and first.session
    agent._on_connect(session_present=True)  # the broker kept our queued tasks: same session
    agent._on_connect(session_present=False)  # it lost them: the coordinator must resend
    drain()
    assert [r.session == first.session for r in registers[4:]] == [True, False]


def test_a_rate_limited_agent_registers_again_after_a_back_off_and_only_for_the_coordinator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from edge_agent import membership
    from protocol.contract.codec import encode
    from protocol.contract.messages import RATE_LIMITED

    monkeypatch.setattr(membership, "RATE_LIMIT_BACKOFF_S", 0.05)
    broker = MemoryBroker()
    coord = FakeCoordinator(broker)
    agent = make(tmp_path, broker)
    agent.start()
    coord.next(Register)
    topic = Topics().down("agent0", "error")
    error = ErrorReply(code=RATE_LIMITED, reason="registration rate", ref_id="x")
    stop = threading.Event()
    runner = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    runner.start()
    try:
        # Execute: a forger's deferral changes nothing; the coordinator's brings a new register
        coord.transport.publish(topic, encode(Envelope(body=error, sender="agent7")))
        coord.transport.publish(topic, encode(Envelope(body=error, sender="coordinator")))
        again = coord.next(Register)
    finally:
        stop.set()
        runner.join(timeout=30)
    # Assert: one deferral counted (the forged one ignored), and the same session again
    assert agent._rate_limited == 1 and again.body.device_id == "agent0"


def _weights(agent) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in agent.ctx.model.state_dict().items()}


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in a)


def _answered(tmp_path: Path):
    """An agent that answered attempt 0 of a step, the coordinator's end, and the reply."""
    broker = MemoryBroker()
    coord = FakeCoordinator(broker)
    agent = make(tmp_path, broker)
    agent.start()
    agent.dispatch(Envelope(body=task("run.0.0.agent0"), sender="coordinator"))
    return agent, coord, coord.next(Reply)


def test_a_retry_of_the_answered_step_gets_the_same_answer_without_training(
    tmp_path: Path,
) -> None:
    # Prepare: the agent answered attempt 0 of a step
    agent, coord, first = _answered(tmp_path)
    trained, rounds = _weights(agent), len(agent.history)
    # Execute: the coordinator retries the step (same inputs, a new task id)
    agent.dispatch(Envelope(body=task("run.0.1.agent0"), sender="coordinator"))
    again = coord.next(Reply)
    # Assert: the same payloads under the new id, a new message, no second training
    assert isinstance(again.body, Reply) and isinstance(first.body, Reply)
    assert again.body.task_id == "run.0.1.agent0" and again.msg_id != first.msg_id
    before, after = first.body.payloads["protos"], again.body.payloads["protos"]
    assert isinstance(before, PrototypeSet) and isinstance(after, PrototypeSet)
    assert np.array_equal(before.vectors, after.vectors)
    assert again.body.metrics == first.body.metrics
    assert _same(_weights(agent), trained) and len(agent.history) == rounds
    # a step with other inputs trains
    agent.dispatch(
        Envelope(body=task("run.1.0.agent0", payloads={"protos": before}), sender="coordinator")
    )
    assert isinstance(coord.next(Reply).body, Reply)
    assert not _same(_weights(agent), trained) and len(agent.history) == rounds + 1


def test_a_refused_answer_is_computed_afresh_on_the_retry(tmp_path: Path) -> None:
    agent, coord, first = _answered(tmp_path)
    trained = _weights(agent)
    refusal = Ack(ref_id=first.msg_id, accepted=False, reason="reply.payloads: out of bounds")
    agent.dispatch(Envelope(body=refusal, sender="coordinator"))
    # Execute
    agent.dispatch(Envelope(body=task("run.0.1.agent0"), sender="coordinator"))
    again = coord.next(Reply)
    # Assert: trained again for the retry
    assert isinstance(again.body, Reply) and again.body.task_id == "run.0.1.agent0"
    assert not _same(_weights(agent), trained)


def _trained(agent: EdgeAgent, *rounds: int) -> dict[str, torch.Tensor]:
    for n in rounds:
        agent.dispatch(Envelope(body=train_task("fedproto", n), sender="coordinator"))
    return {k: v.clone() for k, v in agent.ctx.model.state_dict().items()}


def test_a_restarted_agent_trains_its_next_round_as_one_that_never_stopped(
    tmp_path: Path,
) -> None:
    # Prepare: one agent trains rounds 1 and 2; another stops after round 1 and restarts
    steady = _trained(memory_agent(tmp_path / "steady", MemoryBroker()), 1, 2)
    broker = MemoryBroker()
    first = memory_agent(tmp_path / "restarted", broker)
    _trained(first, 1)
    first.endpoint.transport.close()
    # Execute: a fresh process on the same state directory trains round 2
    again = memory_agent(tmp_path / "restarted", broker)
    restarted = _trained(again, 2)
    # Assert: the batch order went on from where it stopped, so the weights are the same bit
    # for bit (restarting the stream from its seed would replay round 1's batches)
    assert again.algorithm.random_streams().keys() == {"batch_order"}
    for k, v in steady.items():
        assert torch.equal(restarted[k], v), k
