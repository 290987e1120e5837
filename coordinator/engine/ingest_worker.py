"""``coordinator ingest-worker``: one of N processes that take a run's replies off the broker.

Each worker holds a member of the MQTT shared subscription ``$share/{group}/{base}/dev/+/up/
reply`` (the broker hands each reply to one member; ``group`` is the run's, random), judges
every reply with the engine's own :class:`~coordinator.engine.replies.ReplyDesk` against the step
the
round leader opened (read from the run's store), stores the valid ones as received in that
store, commits, and only then acknowledges them: the contract of the in-process path, in
another process with its own GIL. The round leader (``coordinator serve`` with
``run.ingest_workers`` = N) reads them from the store when the step closes
(``coordinator/engine/ingest.py``; design: ``docs/howto/run-at-scale.md``).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator.config import RunConfig, build_config
from coordinator.engine.ingest import share_group
from coordinator.engine.metrics import REFUSED
from coordinator.engine.replies import (
    AckFrames,
    AgentBook,
    ReplyDesk,
    screen,
    take_batch,
    task_id,
)
from coordinator.engine.runner import UNSIGNED_KINDS, mqtt_client
from coordinator.store.connection import CHECKPOINT_S
from coordinator.store.database import Staged, Store
from coordinator.strategies import AgentInfo, Step, create_strategy
from protocol.contract.codec import Envelope, encode
from protocol.contract.messages import Ack, CoordinatorState, Reply, Status
from protocol.contract.topics import COORDINATOR_ID, Topics, shared
from protocol.logs import RefusalLog
from protocol.transport.base import Will
from protocol.transport.endpoint import Endpoint

if TYPE_CHECKING:
    from protocol.security.keys import SigningKeys
    from protocol.transport.address import BrokerAddress

__all__ = [
    "IngestWorker",
    "open_run_store",
    "run_ingest_worker",
    "spawned_workers",
    "worker_argv",
    "worker_will",
]

Judged = tuple[Envelope, Reply, Any]


def open_run_store(run_dir: Path, wait_s: float) -> tuple[Store, RunConfig]:
    """The run's store and config, once the round leader has created them (waits ``wait_s``)."""
    path, end = Path(run_dir) / "state.sqlite", time.monotonic() + wait_s
    while True:
        if path.exists():
            # no run-directory lock (the leader holds it); checkpoints off the reply path
            store = Store(path, checkpoint_s=CHECKPOINT_S)
            stored = store.get_meta("config")
            if stored is not None:
                return store, build_config({"run": {}, "hyper": {}}, stored)
            store.close()
        if time.monotonic() > end:
            raise TimeoutError(f"no coordinator run in {run_dir} after {wait_s:.0f} s")
        time.sleep(0.2)


def worker_will(cfg: RunConfig, worker: str) -> Will:
    """Retained ``offline``: the leader then sends the open tasks again."""
    body = Status(state="offline")
    env = Envelope(body=body, sender=COORDINATOR_ID, federation=cfg.federation)
    return Will(Topics(cfg.federation).ingest(worker), encode(env))


class IngestWorker:
    """Judge, store and acknowledge the replies one shared-subscription member receives."""

    def __init__(
        self,
        cfg: RunConfig,
        store: Store,
        endpoint: Endpoint,
        worker: str,
        logger: logging.Logger | None = None,
    ) -> None:
        self.cfg, self.store, self.endpoint, self.worker = cfg, store, endpoint, worker
        self.topics = Topics(cfg.federation)
        self.log = logger or logging.getLogger(f"edgefl.ingest.{worker}")
        self.refusals = RefusalLog(self.log, what="messages")  # a flood: a few lines, then sums
        strategy = create_strategy(
            cfg.algorithm, cfg.algorithm_config(), num_classes=cfg.num_classes, seed=cfg.seed
        )
        self.desk = ReplyDesk(strategy, store)
        self.ack_frames = AckFrames(endpoint)
        self.inbox: queue.Queue[tuple[Envelope, str]] = queue.Queue()  # replies to judge
        self.done = threading.Event()  # the run finished
        self.counts: Counter[str] = Counter()  # stored, acked, refused, deferred, rejected.*
        self.lock_wait_s = 0.0  # time spent waiting for the store's write lock
        self._received = 0  # reply bytes received up to the last batch (the endpoint's count)
        self._refused: dict[str, int] = {}  # and refused bytes, by key
        self._intake: dict[str, Any] | None = None
        self._step: Step | None = None
        self._participants: set[str] = set()
        self._agents: dict[str, AgentInfo] = {}
        self._book = AgentBook(store)  # the fleet, re-read each step, decoded once an agent

    # ----- wiring ---------------------------------------------------------------------------
    def start(self) -> None:
        """Subscribe (before the transport connects) and announce on every connect."""

        def take(env: Envelope, topic: str) -> None:
            self.inbox.put((env, topic))

        # the run's own, unguessable share group (coordinator.engine.ingest.new_share_group)
        group = share_group(self.store)
        self.endpoint.subscribe(shared(group, f"{self.topics.base}/dev/+/up/reply"), take)
        # a chunked reply's chunks travel on its chunk topic (up/reply/chunk), which this
        # filter does not match: the round leader takes and reassembles them itself
        # a reply resent after its ack was lost is a duplicate for the endpoint: judge it again
        self.endpoint.on_duplicate = take
        self.endpoint.subscribe(self.topics.coord_state, self._on_state)
        self.endpoint.transport.add_connect_listener(lambda _present: self._announce("online"))
        if self.endpoint.transport.connected:
            self._announce("online")

    def _announce(self, state: str) -> None:
        body = Status(state=state)  # type: ignore[arg-type]
        self.endpoint.send(self.topics.ingest(self.worker), body, retain=True)

    def _on_state(self, env: Envelope, _topic: str) -> None:
        body = env.body
        if not isinstance(body, CoordinatorState) or env.sender != COORDINATOR_ID:
            return
        if (
            body.run_id == self.cfg.run_id
            and body.state == "finished"
            and self.endpoint.trusted(env)
        ):
            self.done.set()

    def stop(self) -> None:
        """Leave cleanly: the leader learns it (a clean disconnect sends no will)."""
        self._announce("offline")

    # ----- the loop -------------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None) -> None:
        """Take replies until the run finishes or ``stop`` is set."""
        stop = stop or threading.Event()
        while not stop.is_set() and not self.done.is_set():
            batch = take_batch(self.inbox, 0.2)
            if batch:
                self.process(batch)

    def process(self, batch: list[tuple[Envelope, str]]) -> None:
        """Judge ``batch`` outside the write lock, store it in one transaction, then ack."""
        self._refresh()
        self.desk.prefetch([env.msg_id for env, _ in batch if isinstance(env.body, Reply)])
        judged = [j for env, topic in batch if (j := self._judge(env, topic)) is not None]
        staged = self._stage(judged)  # the bytes, durably, before taking the write lock
        acks = []
        t0 = time.perf_counter()
        with self.store.transaction():
            self.lock_wait_s += time.perf_counter() - t0
            heard = {env.sender: None for env, _, _ in judged if env.sender in self._agents}
            self.store.touch_agents(heard)  # last seen, for `coordinator status`
            for env, _reply, verdict in self._keep(judged, staged):
                frame = self.endpoint.seal(self.ack_frames.unsigned(verdict.ack))
                acks.append((self.topics.down(env.sender, "ack"), frame))
            self._count_traffic(sum(len(frame) for _, frame in acks))
        # after the commit: an acknowledged update is durable
        self.endpoint.send_many_sealed(acks, kind=Ack.KIND, round=0)
        self.counts["acked"] += len(acks)

    def _count_traffic(self, ack_bytes: int) -> None:
        """The replies received since the last batch and this batch's acks, under the open
        step (inside the batch's transaction): the leader adds them to the step's record,
        whose byte figures would otherwise miss every reply and ack a worker handled."""
        traffic = self.endpoint.traffic
        received = traffic.snapshot().get("rx.reply", 0)
        refused = {REFUSED + k: n for k, n in traffic.refused_snapshot().items()}
        counts = {
            "rx.reply": received - self._received,
            "tx.ack": ack_bytes,
            **{k: n - self._refused.get(k, 0) for k, n in refused.items()},
        }
        self._received, self._refused = received, refused
        if self._intake is not None:
            self.store.add_worker_traffic(self._intake["step"], counts)

    def _judge(self, env: Envelope, topic: str) -> Judged | None:
        refused = screen(self.topics, env, topic, self.endpoint.trusted(env))
        if refused is None and not isinstance(env.body, Reply):
            refused = "unexpected_kind", f"{env.kind} from {env.sender} on {topic}"
        if refused is not None:
            self._count_reject(*refused)
            self.endpoint.refuse(env)
            return None
        assert isinstance(env.body, Reply)  # checked just above (for mypy)
        device, step = env.sender, self._step
        task = None
        if step is not None and self._intake is not None and device in self._participants:
            task = task_id(self.cfg.run_id, self._intake["step"], self._intake["attempt"], device)
        verdict = self.desk.judge(env, env.body, step, task, self._agents.get(device))
        if verdict.reject is not None:
            self._count_reject(*verdict.reject)
            self.endpoint.refuse(env)
        return env, env.body, verdict

    def _stage(self, judged: list[Judged]) -> list[Staged]:
        """The replies to store, their bytes written to this worker's segment of the open step
        (outside the write lock: :meth:`Store.stage_updates`)."""
        if self._intake is None:
            return []
        rows = [
            (env.sender, env.msg_id, reply.task_id, env.wire or encode(env))
            for env, reply, verdict in judged
            if verdict.ack is not None and verdict.store
        ]
        return self.store.stage_updates(self._intake["step"], rows) if rows else []

    def _keep(self, judged: list[Judged], staged: list[Staged]) -> list[Judged]:
        """Store what the verdicts say (``staged``: their rows; inside the transaction, one
        statement a batch); the ones to acknowledge."""
        intake, answered = self._intake, []
        for item in judged:
            if item[2].ack is None:
                self.counts["deferred"] += 1
            else:
                answered.append(item)
        if intake is not None and staged:
            stored = self.store.add_updates_if_open(intake, staged)
            if stored is None:  # the leader closed the step meanwhile: as if none was open
                self.counts["deferred"] += len(staged)
                answered = [item for item in answered if not item[2].store]
                stored = set()
            self.counts["stored"] += len(stored)
            for msg_id in stored:
                self.desk.mark_stored(msg_id)
        for env, _, verdict in answered:
            if verdict.fail is not None and intake is not None:
                self.store.add_refusal(intake["step"], intake["attempt"], env.sender, verdict.fail)
        return answered

    def _count_reject(self, counter: str, detail: str) -> None:
        self.counts[f"rejected.{counter}"] += 1
        self.refusals(counter, "rejected (%s): %s", counter, detail)

    def _refresh(self) -> None:
        """Follow the leader: the open step, its participants, the global state, the fleet."""
        intake = self.store.intake()
        if intake == self._intake:
            return
        previous, self._intake = self._intake, intake
        if intake is None:
            self._step = None
            return
        rec = self.store.step(intake["step"])
        self._participants = set(rec.participants) if rec is not None else set()
        self._step = Step(intake["round"], intake["phase"], intake["participation"])
        if previous is None or previous.get("step") != intake["step"]:
            self.desk.strategy.load_state_dict(self.store.global_state())
        self._agents = self._book.read()
        participants = (self._agents[d] for d in self._participants if d in self._agents)
        self.desk.strategy.observe_fleet(participants)  # as the leader: the same dimension


def run_ingest_worker(
    run_dir: Path,
    host: str,
    port: int,
    worker: str,
    *,
    signing: SigningKeys | None = None,
    stop: threading.Event | None = None,
    wait_s: float = 60.0,
    logger: logging.Logger | None = None,
    **transport_options: Any,
) -> Counter[str]:
    """Connect one worker to the broker and take replies until the run finishes."""
    store, cfg = open_run_store(run_dir, wait_s)
    try:
        # a clean session: the broker keeps no queue for a dead member, so the share group's
        # messages go to the members alive (a kept session would hold its share of them)
        websockets = transport_options.get("websocket_path") is not None
        transport = mqtt_client(cfg, websockets=websockets)(
            host=host,
            port=port,
            client_id=f"edgefl-ingest-{cfg.federation}-{worker}",
            will=worker_will(cfg, worker),
            clean_session=True,
            **transport_options,
        )
        options = {} if signing is None else signing.endpoint_options(UNSIGNED_KINDS)
        endpoint = Endpoint(transport, sender=COORDINATOR_ID, federation=cfg.federation, **options)
        ingest = IngestWorker(cfg, store, endpoint, worker, logger)
        ingest.start()
        transport.connect(retry_for=wait_s)
        try:
            ingest.run(stop)
        finally:
            ingest.stop()
            transport.close()
        ingest.counts["lock_wait_ms"] = round(1e3 * ingest.lock_wait_s)  # for the benchmark
        return ingest.counts
    finally:
        store.close()


def worker_argv(
    cfg: RunConfig, broker: BrokerAddress, worker: str, options: Sequence[str] = ()
) -> list[str]:
    """The command line of one ``coordinator ingest-worker`` of ``cfg``'s run (``options``:
    ``--kit``, ``--credentials``, ``--no-signing`` as the leader was given them)."""
    command = [sys.executable, "-m", "coordinator.cli", "ingest-worker"]
    return [*command, "--run-dir", cfg.run_dir, "--broker", str(broker), "--id", worker, *options]


@contextlib.contextmanager
def spawned_workers(
    cfg: RunConfig,
    broker: BrokerAddress,
    options: Sequence[str] = (),
    *,
    leave_s: float = 30.0,
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``run.ingest_workers`` worker processes on this host for the block (``serve
    --spawn-workers``), each logging to ``RUN_DIR/ingest/wK.log``. After the block they get
    ``leave_s`` to leave by themselves (they do once the run's state says ``finished``); any
    still running then is terminated."""
    logs = Path(cfg.run_dir) / "ingest"
    logs.mkdir(parents=True, exist_ok=True)
    workers: list[subprocess.Popen[bytes]] = []
    try:
        for k in range(1, cfg.ingest_workers + 1):
            with (logs / f"w{k}.log").open("ab") as out:
                argv = worker_argv(cfg, broker, f"w{k}", options)
                workers.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT))
        yield workers
    finally:
        end = time.monotonic() + leave_s
        for proc in workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, end - time.monotonic()))
            if proc.poll() is None:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
            if proc.poll() is None:
                proc.kill()
