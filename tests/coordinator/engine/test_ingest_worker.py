"""An ingest worker judges replies with the engine's own checks: a reply stored once
however often it comes, a hostile one refused with the engine's error and nothing stored, and
nothing stored once the leader has closed the step. Over the in-memory transport."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.config import RunConfig
from coordinator.engine.core import Coordinator
from coordinator.engine.ingest import WorkerIntake
from coordinator.engine.ingest_worker import IngestWorker
from coordinator.engine.replies import task_id
from coordinator.engine.step import OpenStep
from coordinator.store.database import Staged, StepRecord, Store
from coordinator.strategies import AgentInfo, Step, create_strategy
from protocol.contract.chunking import split_frame
from protocol.contract.codec import Envelope, decode, encode
from protocol.contract.messages import Ack, Register, Reply, Status, Task
from protocol.contract.payloads import PrototypeSet
from protocol.contract.topics import COORDINATOR_ID, Topics
from protocol.errors import ValidationError
from protocol.transport.base import MemoryBroker, MemoryTransport
from protocol.transport.endpoint import Endpoint
from tests.helpers import fake_agent
from tests.helpers_runtime import run_config

DEVICE = "dev1"
HELD = [1, 4]  # the classes DEVICE registered


def register(device: str = DEVICE) -> Register:
    counts = {c: 30 for c in HELD}
    return fake_agent(
        device, "fedproto", counts, num_classes=10, arch="mlp_s", num_params=1000
    ).register


def frame(body: Any, sender: str = DEVICE, round_: int = 1) -> Envelope:
    """An envelope as the worker's endpoint delivers it: decoded, with its wire bytes."""
    return decode(encode(Envelope(body=body, sender=sender, federation="default", round=round_)))


def reply(classes: list[int], *, attempt: int = 0) -> Reply:
    protos = PrototypeSet(
        class_ids=np.array(classes, dtype=np.int32),
        vectors=np.ones((len(classes), 16), dtype=np.float32),
        counts=np.full(len(classes), 10, dtype=np.int32),
    )
    return Reply(
        task_id=task_id("t", 0, attempt, DEVICE),
        round=1,
        phase="train",
        num_samples=40,
        payloads={"protos": protos},
        metrics={"acc_local": 0.5},
    )


def received(endpoint: Endpoint) -> dict[str, int]:
    """The bytes ``endpoint`` counted as received, per kind."""
    return {k: n for k, n in endpoint.traffic.snapshot().items() if k.startswith("rx.")}


class Setup:
    """A run store with DEVICE registered and step 0 open to workers, and one worker on it."""

    def __init__(self, tmp_path: Path) -> None:
        self.cfg: RunConfig = run_config(tmp_path, "fedproto", rounds=1, ingest_workers=1)
        self.store = Store(Path(self.cfg.run_dir) / "state.sqlite")
        self.store.set_meta("config", self.cfg.to_dict())
        self.store.upsert_agent(DEVICE, encode(frame(register())), online=True)
        self.store.open_step(StepRecord(0, 1, "train", [DEVICE], "open", 0))
        self.intake = {"step": 0, "attempt": 0, "round": 1, "phase": "train"}
        self.store.set_intake({**self.intake, "participation": "sample"})
        self.broker = broker = MemoryBroker()
        self.acks: list[Ack] = []
        listener = MemoryTransport(broker, "listener")
        listener.connect()
        listener.subscribe(
            Topics().down(DEVICE, "ack"), lambda _t, data: self.acks.append(decode(data).body)
        )
        transport = MemoryTransport(broker, "worker")
        transport.connect()
        endpoint = Endpoint(transport, sender=COORDINATOR_ID)
        self.worker = IngestWorker(self.cfg, self.store, endpoint, "w1")
        self.worker.start()
        self.topic = Topics().up(DEVICE, "reply")

    def stored(self) -> list[tuple[str, str, bytes]]:
        return self.store.updates(0)


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    return Setup(tmp_path)


def test_a_reply_is_stored_once_however_often_it_arrives(setup: Setup) -> None:
    # Prepare: the same reply three times (a resend after a lost ack, in one batch and later)
    env = frame(reply(HELD))

    # Execute
    setup.worker.process([(env, setup.topic), (env, setup.topic)])
    setup.worker.process([(env, setup.topic)])

    # Assert: one row, the frame as received; every copy acknowledged as accepted
    assert setup.stored() == [(DEVICE, env.msg_id, env.wire)]
    assert [(a.ref_id, a.accepted) for a in setup.acks] == [(env.msg_id, True)] * 3
    assert setup.worker.counts["stored"] == 1


def test_another_reply_of_the_same_device_and_step_is_not_stored_again(setup: Setup) -> None:
    # Prepare: the agent answered the same task twice (two message ids)
    first, second = frame(reply(HELD)), frame(reply(HELD))

    # Execute
    setup.worker.process([(first, setup.topic)])
    setup.worker.process([(second, setup.topic)])

    # Assert: the unique key (step, device) keeps the first one
    assert [msg_id for _, msg_id, _ in setup.stored()] == [first.msg_id]


def test_a_batch_stores_each_devices_first_reply_of_the_step_and_acks_every_one(
    setup: Setup,
) -> None:
    # Prepare: a second device, and one batch of: dev1's reply twice (two message ids, the
    # second a new answer to the same task), dev2's reply
    other = "dev2"
    setup.store.upsert_agent(other, encode(frame(register(other), sender=other)), online=True)
    setup.store.open_step(StepRecord(0, 1, "train", [DEVICE, other], "open", 0))
    first, again = frame(reply(HELD)), frame(reply(HELD))
    second_reply = reply(HELD)
    second = frame(
        Reply(
            task_id=task_id("t", 0, 0, other),
            round=1,
            phase="train",
            num_samples=40,
            payloads=second_reply.payloads,
            metrics={},
        ),
        sender=other,
    )
    batch = [(first, setup.topic), (again, setup.topic), (second, Topics().up(other, "reply"))]

    # Execute
    setup.worker.process(batch)

    # Assert: one row a device, its first reply; the batch's replies all acknowledged
    assert [(d, m) for d, m, _ in setup.stored()] == [
        (DEVICE, first.msg_id),
        (other, second.msg_id),
    ]
    assert setup.worker.counts["stored"] == 2
    assert setup.worker.counts["acked"] == 3


def test_a_batchs_bytes_are_written_before_the_write_lock_is_taken(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the segment's fdatasync outside the transaction: it does not hold the other writers up
    stage = setup.store.stage_updates
    locked_while_staging: list[bool] = []

    def spy(step: int, rows: list[tuple[str, str, str, bytes]]) -> list[Staged]:
        locked_while_staging.append(setup.store.db.in_transaction)
        return stage(step, rows)

    monkeypatch.setattr(setup.store, "stage_updates", spy)
    setup.worker.process([(frame(reply(HELD)), setup.topic)])

    assert locked_while_staging == [False] and setup.worker.counts["stored"] == 1


def test_the_fleet_is_decoded_once_an_agent_and_again_when_it_registers_again(
    setup: Setup,
) -> None:
    # Prepare
    from coordinator.engine.replies import AgentBook

    book = AgentBook(setup.store)
    first = book.read()

    # Execute: nothing changed; then dev2 joins and dev1 registers again; then a row that is
    # not a registration
    same = book.read()
    setup.store.upsert_agent("dev2", encode(frame(register("dev2"), sender="dev2")), True)
    setup.store.upsert_agent(DEVICE, encode(frame(register())), online=True)
    changed = book.read()
    setup.store.upsert_agent("dev3", encode(frame(Status(state="online"), sender="dev3")), True)
    last = book.read()

    # Assert: an unchanged registration is the same object, a new one a new object
    assert same[DEVICE] is first[DEVICE]
    assert changed[DEVICE] is not first[DEVICE]
    assert changed[DEVICE].register == first[DEVICE].register
    assert sorted(changed) == [DEVICE, "dev2"]
    assert sorted(last) == [DEVICE, "dev2"]
    assert last["dev2"] is changed["dev2"]


def test_a_hostile_reply_is_refused_with_the_engines_error_and_nothing_is_stored(
    setup: Setup,
) -> None:
    # Prepare: prototypes of a class the device never registered
    hostile = frame(reply([1, 7]))
    strategy = create_strategy("fedproto", setup.cfg.algorithm_config(), num_classes=10)
    engine = Coordinator(setup.cfg, setup.worker.endpoint, setup.store, strategy)
    with pytest.raises(ValidationError) as engine_error:
        engine.desk.check(Step(1, "train"), AgentInfo(DEVICE, register()), hostile.body)

    # Execute
    setup.worker.process([(hostile, setup.topic)])
    valid = frame(reply(HELD))
    setup.worker.process([(valid, setup.topic)])  # the worker keeps going

    # Assert
    refused, accepted = setup.acks
    assert (refused.ref_id, refused.accepted) == (hostile.msg_id, False)
    assert refused.reason == str(engine_error.value)
    assert "classes the agent registered" in refused.reason
    # unsigned: it may be a forgery, so the leader keeps waiting for the device
    assert setup.store.refusals(0, 0) == []
    assert (accepted.ref_id, accepted.accepted) == (valid.msg_id, True)
    assert [msg_id for _, msg_id, _ in setup.stored()] == [valid.msg_id]
    assert setup.worker.counts["rejected.invalid_reply"] == 1


def test_a_reply_on_another_devices_topic_or_of_another_kind_is_dropped(setup: Setup) -> None:
    # Prepare
    forged = frame(reply(HELD), sender="dev2")
    status = frame(Status(state="online"))

    # Execute
    setup.worker.process([(forged, setup.topic), (status, setup.topic)])

    # Assert: nothing stored, nothing acknowledged
    assert setup.stored() == [] and setup.acks == []
    assert setup.worker.counts["rejected.sender_mismatch"] == 1
    assert setup.worker.counts["rejected.unexpected_kind"] == 1


def test_a_reply_to_another_attempt_is_refused_as_late(setup: Setup) -> None:
    # Execute
    old = frame(reply(HELD, attempt=1))
    setup.worker.process([(old, setup.topic)])

    # Assert
    assert setup.stored() == []
    assert [(a.accepted, a.reason) for a in setup.acks] == [(False, "late or unknown task")]


def test_nothing_is_stored_or_acknowledged_once_the_leader_closed_the_step(
    setup: Setup,
) -> None:
    # Prepare: the worker saw the step open, then the leader closed it
    setup.worker.process([])
    setup.store.set_intake(None)
    env = frame(reply(HELD))

    # Execute: judged against the step it saw; the store refuses it under the write lock
    judged = setup.worker._judge(env, setup.topic)
    assert judged is not None and judged[2].store
    staged = setup.worker._stage([judged])
    with setup.store.transaction():
        kept = setup.worker._keep([judged], staged)

    # Assert: no ack (the agent keeps it in its outbox), no row
    assert not kept
    assert setup.stored() == []
    assert setup.worker.counts["deferred"] == 1


def test_a_spawned_workers_command_line_names_the_run_broker_and_credentials(
    tmp_path: Path,
) -> None:
    from coordinator.engine.ingest_worker import worker_argv
    from protocol.transport.address import BrokerAddress, parse_broker

    cfg = run_config(tmp_path, "fedproto", rounds=1, ingest_workers=2)
    argv = worker_argv(cfg, BrokerAddress("::1", 1883), "w2", ["--kit", "kits/coordinator"])
    assert argv[1:4] == ["-m", "coordinator.cli", "ingest-worker"]
    assert argv[4:] == [
        "--run-dir", cfg.run_dir, "--broker", "[::1]:1883", "--id", "w2", "--kit",
        "kits/coordinator",
    ]  # fmt: skip
    assert worker_argv(cfg, BrokerAddress("broker.local", 8883), "w1")[-4:] == [
        "--broker", "broker.local:8883", "--id", "w1",
    ]  # fmt: skip
    wss = parse_broker("wss://broker.local/edge")  # the leader's URL, as it was given
    assert worker_argv(cfg, wss, "w1")[-4:] == [
        "--broker", "wss://broker.local:443/edge", "--id", "w1",
    ]  # fmt: skip


def test_spawn_workers_without_ingest_workers_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from coordinator.cli import main

    argv = ["serve", "--run-dir", str(tmp_path / "r"), "--spawn-workers", "--broker", "x:1"]
    assert main(argv) != 0
    out = capsys.readouterr()
    assert "--spawn-workers starts run.ingest_workers processes, but run.ingest_workers is 0" in (
        out.err
    )
    assert "run directory" not in out.out  # refused before anything started


def test_chunks_pass_the_workers_by_and_one_on_the_reply_topic_is_refused(setup: Setup) -> None:
    # Prepare: a reply's chunk frames, and an agent's connection to the broker
    whole = encode(Envelope(body=reply(HELD), sender=DEVICE, federation="default", round=1))
    chunks = [
        encode(Envelope(body=c, sender=DEVICE, federation="default", round=1))
        for c in split_frame(whole, 256)
    ]
    agent = MemoryTransport(setup.broker, DEVICE)
    agent.connect()
    # Execute: the chunks on their chunk topic, as an agent's endpoint sends them; then one
    # on the reply topic itself, where the workers' shared subscription takes it
    for data in chunks:
        agent.publish(Topics().chunk_topic(setup.topic), data)
    assert received(setup.worker.endpoint) == {}  # the round leader's to take
    agent.publish(setup.topic, chunks[0])
    # Assert: that one refused, counted as invalid; nothing judged, stored or acked
    assert len(chunks) > 1 and setup.worker.endpoint.rejected == {"ProtocolError": 1}
    assert setup.worker.endpoint.traffic.refused_snapshot() == {"rx.invalid": len(chunks[0])}
    assert setup.worker.inbox.empty() and setup.stored() == [] and setup.acks == []


def test_each_run_gets_its_own_share_group_and_keeps_it_on_resume(tmp_path: Path) -> None:
    from coordinator.engine.ingest import GROUP, share_group
    from tests.helpers_runtime import start_coordinator

    groups = []
    for name in ("a", "b", "a"):  # run a, run b, run a resumed
        cfg = run_config(tmp_path / name, "fedproto", rounds=1, ingest_workers=1)
        coord = start_coordinator(cfg, MemoryBroker())
        groups.append(share_group(coord.store))
        coord.store.close()
    assert groups[0] == groups[2] != groups[1]
    assert all(g.startswith(f"{GROUP}-") and len(g) == len(GROUP) + 33 for g in groups)


def test_the_leader_takes_each_stored_reply_once_while_the_step_is_open(setup: Setup) -> None:
    # Prepare: the leader's engine with DEVICE's task in flight, and one other device's
    strategy = create_strategy("fedproto", setup.cfg.algorithm_config(), num_classes=10)
    engine = Coordinator(setup.cfg, setup.worker.endpoint, setup.store, strategy)
    engine.agents[DEVICE] = AgentInfo(DEVICE, register())
    rec = StepRecord(0, 1, "train", [DEVICE, "dev2"], "open", 0)
    open_step = OpenStep(rec, Step(1, "train"))
    for device in (DEVICE, "dev2"):
        open_step.sent(device, Task(task_id("t", 0, 0, device), "t", 1, "train", 1e12, "fedproto"))
    intake = WorkerIntake(1, setup.store, Topics())
    env = frame(reply(HELD))
    # Execute: a worker stores DEVICE's reply; the leader polls twice, then closes
    setup.worker.process([(env, setup.topic)])
    engine.collector.take_polled(open_step, intake.poll(open_step))
    taken = open_step.outcome.replies.get(DEVICE)
    engine.collector.take_polled(open_step, intake.poll(open_step))
    engine.collector.take_stored(open_step, worker_checked=True)
    # Assert: taken at the first poll, equal to what was sent, and never read again
    assert isinstance(taken, Reply) and taken.task_id == reply(HELD).task_id
    assert taken.to_wire() == reply(HELD).to_wire()
    assert open_step.outcome.replies[DEVICE] is taken and open_step.read == {DEVICE}
    assert open_step.outstanding == {"dev2"}
    assert intake.poll(open_step) == ([], [])


def test_a_stored_reply_whose_segment_was_damaged_is_logged_and_never_aggregated(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: as above; the worker stores DEVICE's reply, then its segment is cut short
    strategy = create_strategy("fedproto", setup.cfg.algorithm_config(), num_classes=10)
    engine = Coordinator(setup.cfg, setup.worker.endpoint, setup.store, strategy)
    engine.agents[DEVICE] = AgentInfo(DEVICE, register())
    open_step = OpenStep(StepRecord(0, 1, "train", [DEVICE], "open", 0), Step(1, "train"))
    open_step.sent(DEVICE, Task(task_id("t", 0, 0, DEVICE), "t", 1, "train", 1e12, "fedproto"))
    intake = WorkerIntake(1, setup.store, Topics())
    setup.worker.process([(frame(reply(HELD)), setup.topic)])
    (rel,) = {row[0] for row in setup.store.db.execute("SELECT seg FROM updates")}
    (setup.store.path.parent / "replies" / rel).write_bytes(b"")
    # Execute
    with caplog.at_level(logging.ERROR):
        engine.collector.take_polled(open_step, intake.poll(open_step))
    # Assert: the leader goes on; the device replied (no deadline to wait out), nothing taken
    assert open_step.outcome.replies == {} and open_step.outstanding == set()
    assert f"stored reply of {DEVICE} unreadable" in caplog.text
    assert "0 of " in caplog.text  # the segment's own account of what it found


def test_a_reply_the_workers_judged_meets_only_the_strategys_own_rules_again(setup: Setup) -> None:
    # the leader re-runs the strategy's rules (per-step state lives in its process), not the
    # checks a worker of the run made on the reply, the agent and the configuration alone
    strategy = create_strategy("fedproto", setup.cfg.algorithm_config(), num_classes=10)
    engine = Coordinator(setup.cfg, setup.worker.endpoint, setup.store, strategy)
    agent, step = AgentInfo(DEVICE, register()), Step(1, "train")
    loud = reply(HELD)
    loud.payloads["protos"].vectors[0, 0] = 1e9  # type: ignore[union-attr]
    with pytest.raises(ValidationError, match=r"\|value\| <= "):
        engine.desk.check(step, agent, loud)
    engine.desk.check(
        step, agent, loud, worker_checked=True
    )  # bounded by the worker that stored it
    with pytest.raises(ValidationError, match="classes the agent registered"):
        engine.desk.check(step, agent, reply([1, 7]), worker_checked=True)
