"""The round engine over the in-memory transport: quorum, rejection of bad input, resume."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
from helpers import fake_agent

from coordinator.engine.core import Coordinator, QuorumError
from coordinator.strategies import AgentInfo, ServerContext, Step, create_strategy
from coordinator.strategies.fedproto import FedProtoStrategy
from edge_agent.agent import EdgeAgent
from edge_agent.algorithms.base import PhaseResult
from protocol.algorithms import config_type
from protocol.contract.codec import Envelope, decode, encode
from protocol.contract.messages import (
    REFUSED,
    Ack,
    Capabilities,
    ErrorReply,
    InputSpec,
    Progress,
    Register,
    Reply,
    Status,
    Task,
)
from protocol.contract.topics import Topics
from protocol.errors import AdmissionError, AggregationError, ConfigError, ValidationError
from protocol.transport.base import MemoryBroker, MemoryTransport
from tests.helpers_runtime import (
    FLEET,
    InProcessAgent,
    crash_and_resume,
    run_config,
    start_coordinator,
)


def connected(broker: MemoryBroker, client_id: str) -> MemoryTransport:
    """A connected raw client (a rogue device, a listener)."""
    transport = MemoryTransport(broker, client_id)
    transport.connect()
    return transport


def start_agents(cfg, broker, n=3):
    return [InProcessAgent(cfg, broker, i).start() for i in range(n)]


def test_garbage_and_wrong_messages_are_rejected_while_the_run_goes_on(tmp_path: Path) -> None:
    # Prepare
    cfg = run_config(tmp_path, rounds=2)
    broker = MemoryBroker()
    agents = start_agents(cfg, broker)
    coord = start_coordinator(cfg, broker)
    topics = Topics(cfg.federation)
    rogue = connected(broker, "rogue")
    # Execute: garbage bytes, a truncated frame, a wrongly typed message, a spoofed sender
    rogue.publish(topics.up("agent0", "reply"), b"\x00\xffnot msgpack")
    good = encode(
        Envelope(
            body=Progress(task_id="x", round=1, phase="train", step=1, total=2), sender="agent0"
        )
    )
    rogue.publish(topics.up("agent0", "progress"), good[:-5])
    task = Task(task_id="t", run_id="r", round=1, phase="train", deadline=1.0, algorithm="fedproto")
    rogue.publish(topics.up("agent1", "task"), encode(Envelope(body=task, sender="agent1")))
    rogue.publish(topics.up("agent2", "reply"), encode(Envelope(body=task, sender="agent0")))
    result = coord.run()
    # Assert
    assert [m["phase"] for m in result.metrics] == ["train", "train", "final"]
    assert coord.endpoint.rejected["DecodeError"] >= 2
    assert result.rejected["unexpected_kind"] == 1 and result.rejected["sender_mismatch"] == 1
    for a in agents:
        a.close()


def test_a_reply_arriving_while_no_step_is_open_is_deferred_not_refused(tmp_path: Path) -> None:
    # A resumed coordinator hears an agent's resent reply before it reopens the step. Refusing
    # it made the agent drop the update for good (the resumed step then closed one short).
    # Prepare
    cfg = run_config(tmp_path, rounds=1)
    broker = MemoryBroker()
    agents = start_agents(cfg, broker)
    coord = start_coordinator(cfg, broker)
    topics = Topics(cfg.federation)
    acks: list[Ack] = []
    rogue = connected(broker, "rogue")
    rogue.subscribe(
        topics.down("agent0", "ack"), lambda _topic, data: acks.append(decode(data).body)
    )
    early = Envelope(
        body=Reply(task_id=f"{cfg.run_id}.0.0.agent0", round=1, phase="train", num_samples=1),
        sender="agent0",
    )
    # Execute
    rogue.publish(topics.up("agent0", "reply"), encode(early))
    coord.wait_for_agents(3, 60)
    deferred_before_run = coord.deferred
    result = coord.run()
    # Assert
    assert deferred_before_run == 1
    assert not [a for a in acks if a.ref_id == early.msg_id]
    assert "late" not in coord.rejected
    assert [m["phase"] for m in result.metrics] == ["train", "final"]
    for a in agents:
        a.close()


def test_a_finished_run_keeps_its_replies_ids_and_none_of_their_bytes(tmp_path: Path) -> None:
    # Prepare: a two-round run; its store noted after step 1 opened (step 0 retired by then)
    cfg = run_config(tmp_path, rounds=2)
    broker = MemoryBroker()
    agents = start_agents(cfg, broker)
    coord = start_coordinator(cfg, broker)
    seen: list[tuple[int, int]] = []
    retire = coord.store.retire_done_steps

    def noted() -> None:
        retire()
        open_rows = coord.store.db.execute("SELECT COUNT(*) FROM updates WHERE step=0")
        seen.append((coord.store.last_done_step(), open_rows.fetchone()[0]))

    coord.store.retire_done_steps = noted  # type: ignore[method-assign]
    # Execute
    result = coord.run()
    # Assert: each step's replies retired once a later step opened, and at the end of the run
    names = ["agent0", "agent1", "agent2"]
    assert [m["phase"] for m in result.metrics] == ["train", "train", "final"]
    assert seen[:3] == [(-1, 0), (0, 0), (1, 0)] and seen[-1] == (2, 0)
    assert [[d for d, _ in coord.store.aggregated(i)] for i in range(3)] == [names] * 3
    assert coord.store.db.execute("SELECT COUNT(*) FROM updates").fetchone() == (0,)
    coord.store.segments.join()
    assert list((Path(cfg.run_dir) / "replies").iterdir()) == []
    for a in agents:
        a.close()


def test_missing_quorum_is_an_explicit_error(tmp_path: Path) -> None:
    cfg = run_config(
        tmp_path,
        rounds=1,
        min_replies=3,
        deadline_s=3.0,
        grace_s=0.5,
        max_retries=1,
        rejoin_wait_s=1.0,  # the killed agent does not come back: stop waiting for it soon
    )
    broker = MemoryBroker()
    agents = start_agents(cfg, broker)
    coord = start_coordinator(cfg, broker, will=False)
    coord.wait_for_agents(3, 60)
    agents[2].kill()  # vanishes before the first task
    with pytest.raises(QuorumError, match="missed quorum 2 times"):
        coord.run()
    rec = coord.store.step(0)
    assert rec is not None and rec.status == "failed"
    for a in agents[:2]:
        a.close()


class CrashOnceError(Exception):
    pass


def test_restarted_coordinator_resumes_without_double_counting(tmp_path: Path, monkeypatch) -> None:
    # Prepare: the coordinator dies in aggregation of round 2, after all its updates are stored
    cfg = run_config(tmp_path, rounds=3)
    broker = MemoryBroker()
    agents = start_agents(cfg, broker)
    seen: list[tuple[int, list[str]]] = []
    original = FedProtoStrategy.fold_prototypes
    crashed = threading.Event()

    def aggregate(self, step, replies):
        if step.round == 2 and not crashed.is_set():
            crashed.set()
            raise CrashOnceError
        seen.append((step.round, [a.device_id for a, _ in replies]))
        return original(self, step, replies)

    monkeypatch.setattr(FedProtoStrategy, "fold_prototypes", aggregate)
    # Execute: a new coordinator on the same run directory
    second = crash_and_resume(cfg, broker, CrashOnceError)
    updates_before = [u[1] for u in second.store.updates(1)]
    result = second.run()
    # Assert: round 2 aggregated once, from the stored updates, with no update counted twice
    assert len(updates_before) == 3
    assert [r for r, _ in seen] == [1, 2, 3]  # the final phase has no aggregator
    assert seen[1] == (2, ["agent0", "agent1", "agent2"])
    assert [m["round"] for m in result.metrics] == [1, 2, 3, 4]
    assert [m for _, m in second.store.aggregated(1)] == updates_before  # done: ids only
    for a in agents:
        a.close()


def test_a_step_whose_aggregation_fails_is_closed_failed_and_never_replayed(
    tmp_path: Path, monkeypatch
) -> None:
    # Prepare: round 2's aggregation half-updates the strategy, then raises; round 3's first
    # aggregation crashes the coordinator, which is restarted on the same run directory
    cfg = run_config(tmp_path, rounds=3)
    broker = MemoryBroker()
    agents = start_agents(cfg, broker)
    seen: list[int] = []
    original = FedProtoStrategy.fold_prototypes
    crashed = threading.Event()

    def aggregate(self, step, replies):
        if step.round == 2:
            self.protos = None  # a partial mutation the engine must undo
            raise AggregationError("round 2 is poisoned")
        if step.round == 3 and not crashed.is_set():
            crashed.set()
            raise CrashOnceError
        seen.append(step.round)
        return original(self, step, replies)

    monkeypatch.setattr(FedProtoStrategy, "fold_prototypes", aggregate)
    state_after_round_1: list[object] = []

    def record_restored_state(first: Coordinator) -> None:
        original_fail = first.store.fail_step

        def fail_step(step, metrics, reason):
            original_fail(step, metrics, reason)
            state_after_round_1.append(first.strategy.protos)

        monkeypatch.setattr(first.store, "fail_step", fail_step)

    # Execute
    second = crash_and_resume(cfg, broker, CrashOnceError, record_restored_state)
    result = second.run()
    # Assert: round 2 failed once, its replies quarantined, and the restart went on at round 3
    assert seen == [1, 3]  # round 2 was never aggregated again; "final" has no aggregator
    rec = second.store.step(1)
    assert rec is not None and rec.status == "failed"
    assert second.store.updates(1) == []
    assert [q[0] for q in second.store.quarantined(1)] == ["agent0", "agent1", "agent2"]
    assert state_after_round_1[0] is not None  # round 1's prototypes restored, not None
    assert [(m["round"], m.get("status", "done")) for m in result.metrics] == [
        (1, "done"),
        (2, "failed"),
        (3, "done"),
        (4, "done"),
    ]
    assert "round 2 is poisoned" in result.metrics[1]["error"]
    for a in agents:
        a.close()


# A fake notion of feature dimension per architecture: the strategy below admits only agents
# whose dimension matches the first admitted agent's (a Felo-style same-embedding constraint).
FEATURE_DIM = {"mlp_s": 16, "cnn_t1": 16, "mlp_m": 32}


def admit_same_feature_dim(self, agent: AgentInfo, fleet: list[AgentInfo]) -> None:
    dim = FEATURE_DIM[agent.register.arch]
    if fleet and dim != (first := FEATURE_DIM[fleet[0].register.arch]):
        raise AdmissionError(agent.device_id, f"feature dim {dim}; the fleet's is {first}")


def test_a_refused_agent_is_told_why_stops_and_is_never_selected(
    tmp_path: Path, monkeypatch
) -> None:
    # Prepare: agent0 and agent1 (dim 16) are admitted first; then agent2 (dim 32) and a rogue
    # agent running another algorithm register
    monkeypatch.setattr(FedProtoStrategy, "admit", admit_same_feature_dim)
    monkeypatch.setattr(FedProtoStrategy, "admission_rules", True)
    cfg = run_config(tmp_path, rounds=2, min_agents=2)
    broker = MemoryBroker()
    agents = start_agents(cfg, broker, n=2)
    coord = start_coordinator(cfg, broker)
    coord.wait_for_agents(2, 60)
    topics = Topics(cfg.federation)
    heard: list[ErrorReply] = []
    rogue = connected(broker, "rogue")
    rogue.subscribe(topics.down("rogue", "error"), lambda _t, data: heard.append(decode(data).body))
    register = Register(
        device_id="rogue",
        arch="cnn_t1",
        num_params=1,
        capabilities=Capabilities(device="cpu"),
        input_spec=InputSpec(1, 8, 8),
        num_classes=cfg.num_classes,
        class_counts={"0": 1},
        algorithm="fedavg",
    )
    rogue.publish(topics.up("rogue", "register"), encode(Envelope(body=register, sender="rogue")))
    late = InProcessAgent(cfg, broker, 2).start()  # its registration is queued synchronously
    # Execute
    result = coord.run()
    late.close()
    # Assert
    assert late.agent is not None and late.agent.refusal == "feature dim 32; the fleet's is 16"
    assert [(e.code, e.reason) for e in heard] == [
        (REFUSED, "it runs fedavg; this run is fedproto")
    ]
    assert result.rejected["refused_agent"] >= 2
    assert "agent2" not in coord.agents and "rogue" not in coord.agents
    assert all(m["participants"] == ["agent0", "agent1"] for m in result.metrics)
    for a in agents:
        a.close()


def test_server_train_gets_the_run_device_and_a_seed_fixed_per_step(
    tmp_path: Path, monkeypatch
) -> None:
    # Prepare
    cfg = run_config(tmp_path, rounds=1, server_device="cpu", seed=5)
    seen: list[ServerContext] = []

    def server_train(self, step, ctx):
        seen.append(ctx)
        return {"server_seed_low_bits": float(ctx.seed % 1000)}

    monkeypatch.setattr(FedProtoStrategy, "server_train", server_train)
    broker = MemoryBroker()
    agents = start_agents(cfg, broker)
    coord = start_coordinator(cfg, broker, will=False)
    # Execute
    result = coord.run()
    # Assert: one context per step, from (run seed, step index) alone
    assert [(c.step_index, c.device) for c in seen] == [(0, "cpu"), (1, "cpu")]
    assert [c.seed for c in seen] == [ServerContext.for_step(5, i).seed for i in (0, 1)]
    assert result.metrics[0]["aggregate"]["server_seed_low_bits"] == seen[0].seed % 1000
    for a in agents:
        a.close()
    with pytest.raises(ConfigError, match="server_device"):
        run_config(tmp_path, server_device="gpu")


def test_a_reply_with_an_undeclared_payload_is_refused_naming_the_key(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    # Prepare: every agent adds a payload FedProto does not declare
    from edge_agent.algorithms.fedproto import FedProtoEdge
    from protocol.contract.payloads import TensorMap

    original = FedProtoEdge.reply_payloads
    monkeypatch.setattr(
        FedProtoEdge, "reply_payloads", lambda self: {**original(self), "extra": TensorMap({})}
    )
    cfg = run_config(tmp_path, rounds=1, max_retries=0)
    broker = MemoryBroker()
    agents = start_agents(cfg, broker)
    coord = start_coordinator(cfg, broker, will=False)
    # Execute
    with pytest.raises(QuorumError):
        coord.run()
    # Assert
    assert coord.rejected["invalid_reply"] == 3
    assert "reply.payloads.extra: expected one of ['protos'] in phase train" in caplog.text
    for a in agents:
        a.close()


class CoordinatorDiedError(Exception):
    pass


def test_a_deferred_reply_is_accepted_when_it_is_resent(tmp_path: Path) -> None:
    # The coordinator dies while replies are in flight; its successor hears them
    # (resent on its announce) before it reopens the step and defers them. The endpoint
    # remembered their message ids, so the resends the reopened step's tasks provoke were
    # dropped as duplicates: the step waited out its deadline and failed every agent.
    # Prepare: the first coordinator dies as soon as a reply of round 1 is queued
    cfg = run_config(tmp_path, rounds=1, deadline_s=20.0, grace_s=0.0, max_retries=0)
    broker = MemoryBroker()
    agents = start_agents(cfg, broker)

    def die_on_the_first_reply(first: Coordinator) -> None:
        # deterministic: dies as the first reply is handled, before it is stored or acked
        # (a health check that looked for a queued reply raced the batch that consumed it)
        def on_reply(env: Envelope, reply: Reply, open_step: object) -> None:
            raise CoordinatorDiedError

        first.collector.on_reply = on_reply  # type: ignore[method-assign,assignment]

    # Execute: a new coordinator on the same run directory
    second = crash_and_resume(cfg, broker, CoordinatorDiedError, die_on_the_first_reply)
    # the scenario: the successor hears the resent replies before it reopens the step. Left
    # to run(), whether they came before the agents' retained statuses ended its wait for
    # agents was a race (lost once in a full suite under load)
    for _ in range(200):  # bounded: until a resent reply was deferred
        if second.deferred:
            break
        second._pump(0.1)
    result = second.run()
    # Assert: every agent's reply of round 1 counted, none failed on the deadline
    assert second.deferred >= 1
    assert result.metrics[0]["failed"] == {}
    assert sorted(result.metrics[0]["agents"]) == ["agent0", "agent1", "agent2"]
    for a in agents:
        a.close()


DIGIT_NAMES = tuple(str(i) for i in range(10))  # the digits dataset's own class names


def named_register(device_id: str, class_names: list[str]) -> Register:
    return Register(
        device_id=device_id,
        arch="mlp_s",
        num_params=1,
        capabilities=Capabilities(device="cpu"),
        input_spec=InputSpec(1, 8, 8),
        num_classes=10,
        class_counts={"0": 1},
        algorithm="fedproto",
        class_names=class_names,
    )


def test_an_agent_naming_its_classes_otherwise_is_refused_at_the_first_difference(
    tmp_path: Path,
) -> None:
    # Prepare: the run names its classes; agent2 lists the same names in reverse (its labels
    # are mapped by name, so its data is fine, but index 0 means '9' to it); "mute" names none
    cfg = run_config(tmp_path, rounds=1, min_agents=2, classes=list(DIGIT_NAMES))
    broker = MemoryBroker()
    agents = start_agents(cfg, broker, n=2)
    backwards = InProcessAgent(cfg, broker, 2)
    backwards.opts = dataclasses.replace(backwards.opts, classes=DIGIT_NAMES[::-1])
    coord = start_coordinator(cfg, broker)
    topics = Topics(cfg.federation)
    mute = MemoryTransport(broker, "mute")
    mute.connect()
    # Execute
    backwards.start()
    mute.publish(
        topics.up("mute", "register"),
        encode(Envelope(body=named_register("mute", []), sender="mute")),
    )
    coord.wait_for_agents(2, 60)
    for _ in range(600):  # bounded: until both registrations were judged
        if {"agent2", "mute"} <= set(coord.refused):
            break
        coord._pump(0.1)
    assert backwards.agent is not None
    backwards.agent.finished.wait(60)  # the refusal reaches it on its own thread
    # Assert
    reason = "class 0 is '9' on the device, '0' in the federation"
    assert coord.refused["agent2"] == reason
    assert backwards.agent.refusal == reason
    assert coord.refused["mute"].startswith("it names no classes")
    assert coord._online_agents() == ["agent0", "agent1"]
    assert cfg.num_classes == 10  # counted from the names
    backwards.close()
    for a in agents:
        a.close()


def test_an_agent_holding_3_of_10_named_classes_is_admitted_and_aggregated(
    tmp_path: Path,
) -> None:
    # Prepare: agent2 is an image folder with 3 of the 10 digit classes (folders 0, 5, 8):
    # mapped by name onto the run's classes it registers all ten names; label skew is normal
    image = pytest.importorskip("PIL.Image")
    folder = tmp_path / "imgs"
    for c in ("0", "5", "8"):
        (folder / c).mkdir(parents=True)
        for i in range(6):
            image.new("L", (8, 8), color=10 * int(c) + i).save(folder / c / f"{i}.png")
    cfg = run_config(tmp_path, rounds=1, classes=list(DIGIT_NAMES))
    broker = MemoryBroker()
    agents = start_agents(cfg, broker, n=2)
    skewed = InProcessAgent(cfg, broker, 2)
    skewed.opts = dataclasses.replace(skewed.opts, data=str(folder), partition=None)
    agents.append(skewed.start())
    coord = start_coordinator(cfg, broker)
    # Execute
    result = coord.run()
    # Assert
    reg = coord.agents["agent2"].register
    assert reg.class_names == list(DIGIT_NAMES)
    assert set(reg.present_classes()) <= {0, 5, 8}
    train = result.metrics[0]
    assert train["phase"] == "train" and "agent2" in train["agents"]
    assert "refused_agent" not in result.rejected
    for a in agents:
        a.close()


def test_run_classes_set_the_class_count_and_a_different_count_is_a_one_line_error(
    tmp_path: Path,
) -> None:
    from coordinator.config import load_config

    assert load_config(None, ["run.classes=cat,dog,eel"]).num_classes == 3
    assert load_config(None, ['run.classes=["cat", "dog"]']).classes == ("cat", "dog")
    with pytest.raises(ConfigError, match=r"names 2 classes but run\.num_classes is 10"):
        load_config(None, ["run.classes=cat,dog", "run.num_classes=10"])
    with pytest.raises(ConfigError, match=r"duplicate class names \['cat'\]"):
        load_config(None, ["run.classes=cat,dog,cat"])
    with pytest.raises(ConfigError, match="expected a list of class names"):
        load_config(None, ["run.classes=3"])


@pytest.mark.parametrize("reannounce", [False, True], ids=["agents", "coordinator"])
def test_each_task_and_reply_crosses_the_broker_once_in_a_plain_run(
    tmp_path: Path, monkeypatch, reannounce: bool
) -> None:
    # Were agents to register again on the coordinator's `running` announcement, a resent
    # round-1 task would be answered by a resent reply and round 1's traffic counted twice.
    # Both sides prevent it: agents do not register again for a run they registered with, and
    # (checked with agents that still do) the coordinator does not resend a task to the same
    # agent session.
    # Prepare
    if reannounce:
        original = EdgeAgent.on_coordinator_state

        def always_announce(self, state):
            if state.state in ("starting", "running"):
                self.announce()
            original(self, state)

        monkeypatch.setattr(EdgeAgent, "on_coordinator_state", always_announce)
    cfg = run_config(tmp_path, rounds=2)
    broker = MemoryBroker()
    topics = Topics(cfg.federation)
    frames: dict[tuple[str, str, int, str], int] = {}

    def count(topic: str, data: bytes) -> None:
        env = decode(data)
        key = (env.kind, env.body.phase, env.body.round, topics.device_from(topic) or "")
        frames[key] = frames.get(key, 0) + 1

    spy = MemoryTransport(broker, "spy")
    spy.connect()
    spy.subscribe(f"{topics.base}/dev/+/down/task", count)
    spy.subscribe(f"{topics.base}/dev/+/up/reply", count)
    agents = start_agents(cfg, broker)
    coord = start_coordinator(cfg, broker)
    # Execute
    result = coord.run()
    # Assert
    assert len(result.metrics) == 3
    assert frames and {k: n for k, n in frames.items() if n != 1} == {}
    assert len(frames) == 2 * 3 * 3  # task + reply, 3 steps, 3 agents
    # progress heartbeats stay out of the algorithm's bytes, counted on their own
    assert all(not k.endswith(".progress") for m in result.metrics for k in m["bytes"])
    assert all(m["bytes_total"] == sum(m["bytes"].values()) for m in result.metrics)
    assert result.metrics[0]["bytes_progress"] > 0
    for a in agents:
        a.close()


def test_open_step_counts_outstanding_devices_as_tasks_replies_and_failures_come() -> None:
    # The wait loop tests a maintained set instead of set differences each pass.
    from coordinator.engine.step import OpenStep
    from coordinator.store.database import StepRecord
    from coordinator.strategies import Step

    rec = StepRecord(0, 1, "train", ["a", "b", "c"], "open", 0)
    step = OpenStep(rec, Step(round=1, phase="train"))
    task = Task(task_id="t", run_id="r", round=1, phase="train", deadline=0.0, algorithm="fedproto")
    reply = Reply(task_id="t", round=1, phase="train", num_samples=1)
    step.replied("c", reply)  # a resumed step's stored reply: no task is sent for it
    for device in ("a", "b", "c"):
        step.sent(device, task)
    assert step.waiting_for() == {"a", "b"}
    step.replied("a", reply)
    step.sent("a", task)  # a task resent on re-registration does not make it outstanding again
    assert step.waiting_for() == {"b"}
    step.fail("b", "deadline")
    assert step.waiting_for() == set() and not step.outstanding
    assert step.outcome.failed == {"b": "deadline"} and set(step.outcome.replies) == {"a", "c"}


def test_replies_are_stored_byte_for_byte_as_received(tmp_path: Path, monkeypatch) -> None:
    # The coordinator stores the frame it received instead of encoding it again.
    from coordinator.engine import admission, intake

    encoded: list[str] = []

    def spy_encode(env: Envelope) -> bytes:
        encoded.append(env.kind)
        return encode(env)

    monkeypatch.setattr(admission, "encode", spy_encode)  # registrations
    monkeypatch.setattr(intake, "encode", spy_encode)  # replies
    cfg = run_config(tmp_path, rounds=1)
    broker = MemoryBroker()
    topics = Topics(cfg.federation)
    sent: set[bytes] = set()
    spy = MemoryTransport(broker, "spy")
    spy.connect()
    spy.subscribe(f"{topics.base}/dev/+/up/reply", lambda _t, data: sent.add(data))
    agents = start_agents(cfg, broker)
    coord = start_coordinator(cfg, broker)
    stored: list[bytes] = []
    original = coord.store.add_updates

    def record(rows):
        stored.extend(envelope for *_, envelope in rows)
        return original(rows)

    coord.store.add_updates = record  # type: ignore[method-assign]
    coord.run()
    assert stored and set(stored) <= sent
    assert "reply" not in encoded and "register" not in encoded
    for a in agents:
        a.close()


def test_a_quorum_error_while_waiting_names_why_agents_were_refused(tmp_path: Path) -> None:
    # Prepare: a fedproto run; the only device that registers runs fedavg and is refused
    cfg = run_config(tmp_path, rounds=1)
    broker = MemoryBroker()
    coord = start_coordinator(cfg, broker)
    topics = Topics(cfg.federation)
    rogue = connected(broker, "rogue")
    register = dataclasses.replace(named_register("other", []), algorithm="fedavg")
    rogue.publish(topics.up("other", "register"), encode(Envelope(body=register, sender="other")))
    # Execute / Assert: the error says what the agent's log says
    with pytest.raises(QuorumError, match=r"1 refused at registration: 1 x it runs fedavg"):
        coord.wait_for_agents(1, 1.0)


def test_a_reply_claiming_more_samples_than_registered_is_refused_and_the_rest_aggregated(
    tmp_path: Path, caplog
) -> None:
    # num_samples weighs FedAvg's mean; a claim of 10^9 took nearly all the weight.
    # Prepare: agent0 trains honestly but reports 10^9 samples in its train reply
    cfg = run_config(tmp_path, "fedavg", rounds=1, min_agents=3, max_retries=0)  # all selected
    broker = MemoryBroker()
    fleet = dataclasses.replace(FLEET, models=("mlp_s",))  # FedAvg: one architecture
    agents = [InProcessAgent(cfg, broker, i, fleet).start() for i in range(3)]
    forger = agents[0].agent
    assert forger is not None
    honest_handle = forger.algorithm.handle

    def forged_handle(task: Task) -> PhaseResult:
        result = honest_handle(task)
        if task.phase == "train":
            result.num_samples = 10**9
        return result

    forger.algorithm.handle = forged_handle  # type: ignore[method-assign]
    coord = start_coordinator(cfg, broker)
    # Execute
    result = coord.run()
    # Assert
    registered = coord.agents["agent0"].num_samples
    assert 0 < registered < 10**9
    train = result.metrics[0]
    assert train["phase"] == "train" and sorted(train["agents"]) == ["agent1", "agent2"]
    assert result.rejected["invalid_reply"] == 1
    assert (
        f"reply.num_samples: expected <= {registered} registered training samples, got 1000000000"
    ) in caplog.text
    assert result.metrics[-1]["phase"] == "final"  # the final phase reports no bound
    for a in agents:
        a.close()


def test_num_samples_is_bounded_by_the_registration_in_train_steps_only() -> None:
    # Prepare: 5 + 3 registered samples; FedVTC's final phase counts synthetic samples
    strategy = create_strategy("fedproto", config_type("fedproto")(), num_classes=4)
    agent = fake_agent("a", "fedproto", {0: 5, 1: 3})

    def claim(n: int, phase: str = "train") -> Reply:
        return Reply(task_id="t", round=1, phase=phase, num_samples=n)

    # Execute / Assert
    strategy.check_num_samples(Step(1, "train"), agent, claim(8))  # exactly the registration
    with pytest.raises(ValidationError, match=r"reply.num_samples: expected <= 8 registered"):
        strategy.check_num_samples(Step(1, "train"), agent, claim(9))
    strategy.check_num_samples(Step(2, "final", "all"), agent, claim(10**9, "final"))


def test_a_declared_feature_dim_refuses_another_at_registration(tmp_path: Path) -> None:
    # Prepare: a fedproto run declaring 16-dimensional prototypes
    base = run_config(tmp_path, rounds=1)
    cfg = dataclasses.replace(base, hyper={**base.hyper, "feature_dim": 16})
    broker = MemoryBroker()
    coord = start_coordinator(cfg, broker)
    topics = Topics(cfg.federation)
    rogue = connected(broker, "rogue")
    # Execute: 32 (refused), 16 (admitted) and 0 (undisclosed: admitted, checked per reply)
    for device, dim in (("wide", 32), ("fits", 16), ("quiet", 0)):
        reg = dataclasses.replace(named_register(device, []), feature_dim=dim)
        rogue.publish(topics.up(device, "register"), encode(Envelope(body=reg, sender=device)))
    coord.wait_for_agents(2, 10.0)
    # Assert
    assert coord.refused == {
        "wide": "its features have 32 dimensions; this run's have 16 (--feature-dim 16)"
    }
    assert {"fits", "quiet"} <= set(coord.agents)


def test_registrations_are_logged_one_a_line_then_one_line_a_thousand(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: a fleet past the per-agent lines (a line each was a third of registering
    # 10,000 agents)
    from coordinator.engine.admission import REGISTRATIONS_LOGGED

    # (registration rate unbounded: 2,001 devices register at once)
    cfg = run_config(tmp_path, max_registrations_per_min=0)
    coord = start_coordinator(cfg, MemoryBroker())
    topics = Topics(coord.cfg.federation)
    caplog.set_level("INFO", logger=coord.log.name)
    # Execute
    with coord.store.transaction():
        for i in range(2001):
            env = Envelope(body=named_register(f"d{i:04d}", []), sender=f"d{i:04d}")
            coord._handle(decode(encode(env)), topics.up(env.sender, "register"))
    # Assert
    lines = [r.getMessage() for r in caplog.records if "regist" in r.getMessage()]
    each = [line for line in lines if line.startswith("agent ")]
    assert len(each) == REGISTRATIONS_LOGGED and each[0].startswith("agent d0000 registered")
    assert [line for line in lines if not line.startswith("agent ")] == [
        "1000 agents registered",
        "2000 agents registered",
    ]
    assert len(coord.agents) == 2001


def test_what_a_batch_says_of_an_agent_is_stored_once_in_the_order_it_was_said(
    tmp_path: Path,
) -> None:
    # Prepare: three known agents; one batch holds, per agent: a goes offline; b goes
    # offline, then registers again (online: the later word); c goes offline, then online
    coord = start_coordinator(run_config(tmp_path), MemoryBroker())
    topics = Topics(coord.cfg.federation)

    def envelope(device: str, body: object) -> tuple[Envelope, str]:
        env = Envelope(body=body, sender=device)  # type: ignore[arg-type]
        kind = "register" if isinstance(body, Register) else "status"
        return decode(encode(env)), topics.up(device, kind)

    for d in "abc":
        coord.inbox.put(envelope(d, named_register(d, [])))
    coord._pump(1.0)
    before = {d: seen for d, _, _, seen in coord.store.agent_rows()}
    batch = [
        envelope("a", Status(state="offline")),
        envelope("b", Status(state="offline")),
        envelope("b", named_register("b", [])),
        envelope("c", Status(state="offline")),
        envelope("c", Status(state="online")),
    ]
    # Execute
    for item in batch:
        coord.inbox.put(item)
    coord._pump(1.0)
    # Assert
    rows = {d: (online, seen) for d, _, online, seen in coord.store.agent_rows()}
    assert {d: online for d, (online, _) in rows.items()} == {"a": False, "b": True, "c": True}
    assert all(rows[d][1] >= before[d] for d in "abc")
    assert coord._online_agents() == ["b", "c"]


def test_a_missed_quorum_names_the_failure_most_devices_share() -> None:
    from coordinator.engine.core import _commonest

    shape = "refused: reply.payloads.protos.vectors: expected dimension 3136, got 64"
    failed = {"a": shape, "b": shape, "c": "deadline"}
    assert _commonest(failed) == f"; 2 of 3 failed devices: {shape}"
    assert _commonest({}) == ""


def test_a_quorum_every_device_missed_by_the_deadline_names_the_setting() -> None:
    from coordinator.engine.core import _deadline_hint

    late = {"a": "deadline", "b": "deadline (before it: refused reply: late)"}
    assert _deadline_hint(late, 120.0) == (
        " (every failed device missed the 120 s deadline: a fleet this slow needs a longer "
        "run.deadline_s)"
    )
    assert _deadline_hint({**late, "c": "offline"}, 120.0) == ""
    assert _deadline_hint({}, 120.0) == ""
