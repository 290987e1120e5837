"""An agent told to stop (SIGTERM, SIGINT) while it trains: the one training loop sees the stop
within a batch, the agent sends an ``error`` ``stopped`` instead of a half-trained reply, keeps
the checkpoint of its last completed task, says ``offline`` and exits 128 + the signal."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from edge_agent.cli import EXIT_SIGNAL
from edge_agent.trainer import TensorData, TrainingStoppedError, train_epochs
from models.checkpoint import load_checkpoint
from protocol.algorithms import TrainConfig, config_type
from protocol.contract.codec import Envelope
from protocol.contract.messages import STOPPED, ErrorReply, Progress, Register, Reply, Status, Task
from tests.edge_agent.test_agent_lifecycle import FakeCoordinator, T, agent_argv, state
from tests.helpers_runtime import clean_env


class _CrossEntropy:
    def step_loss(self, x, y, features, logits):
        return torch.nn.functional.cross_entropy(logits, y)

    def after_step(self, x, y, features, logits) -> None:
        pass


def test_a_stop_ends_training_before_the_next_batch() -> None:
    # Prepare: a model, 64 samples at batch 1 for 1,000 epochs; the stop comes at step 3
    from models import create_model

    model = create_model("mlp_s", num_classes=10, in_chans=1, input_size=(8, 8))
    data = TensorData(torch.rand(64, 1, 8, 8), torch.randint(0, 10, (64,)))
    stop = threading.Event()
    steps: list[int] = []

    def progress(step: int, _total: int, _loss: float) -> None:
        steps.append(step)
        if step == 3:
            stop.set()

    # Execute
    with pytest.raises(TrainingStoppedError, match="stopped at step 4 of 64000"):
        train_epochs(
            model,
            data,
            TrainConfig(local_epochs=1000, batch_size=1),
            _CrossEntropy(),
            on_progress=progress,
            stop=stop,
        )
    # Assert: no batch after the stop; the model is back in train mode with its gradients on
    assert steps == [1, 2, 3]
    assert model.training and all(p.requires_grad for p in model.parameters())


class Recorder(FakeCoordinator):
    """A fake coordinator that also records everything ``dev1`` sends and can send it tasks."""

    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.seen: queue.Queue[Envelope] = queue.Queue()
        self.transport.subscribe(f"{T.base}/dev/dev1/#", self._any)

    def _any(self, _topic: str, data: bytes) -> None:
        from protocol.contract.codec import decode

        if data:
            self.seen.put(decode(data))

    def next(self, kind: type, task_id: str = "", timeout: float = 240.0) -> Envelope:
        """The next message of ``kind`` (about ``task_id``, if given) that dev1 sent."""
        while True:
            env = self.seen.get(timeout=timeout)
            if isinstance(env.body, kind) and task_id in ("", getattr(env.body, "task_id", "")):
                return env

    def task(self, task_id: str, round_: int, phase: str = "train", **config: int) -> None:
        body = Task(
            task_id=task_id,
            run_id="r1",
            round=round_,
            phase=phase,
            deadline=1e12,
            algorithm="fedproto",
            config=config_type("fedproto")(**config).to_dict(),
        )
        self.endpoint.send(T.down("dev1", "task"), body, round=round_)


def _agent(port: int, tmp_path: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "edge_agent.cli", *agent_argv(port, tmp_path)]
    argv += ["--algorithm", "fedproto", "--threads", "1"]
    log = (tmp_path / "agent.log").open("wb")
    return subprocess.Popen(argv, env=clean_env(), stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.network
def test_sigterm_during_a_long_task_stops_the_agent_with_its_checkpoint(
    mosquitto, tmp_path: Path
) -> None:
    # Prepare: the agent completes round 1, then gets 1,000 epochs at batch 1 (inside the limits)
    coord = Recorder(mosquitto.port)
    coord.publish(state("running", "r1", 1))
    agent = _agent(mosquitto.port, tmp_path)
    try:
        coord.next(Register)
        coord.task("r1.1.dev1", 1, local_epochs=1)
        coord.next(Reply, "r1.1.dev1")
        coord.task("r1.2.dev1", 2, local_epochs=1000, batch_size=1)
        coord.next(Progress, "r1.2.dev1")  # training the long task
        # Execute
        agent.send_signal(signal.SIGTERM)
        code = agent.wait(timeout=240)
    finally:
        if agent.poll() is None:
            agent.kill()
        coord.transport.close()
    # Assert: exit 128 + SIGTERM, an error "stopped" and no reply for the cut task, "offline"
    log = (tmp_path / "agent.log").read_text()
    assert code == EXIT_SIGNAL + signal.SIGTERM, log
    error = coord.next(ErrorReply, "r1.2.dev1", timeout=30).body
    assert isinstance(error, ErrorReply) and error.code == STOPPED
    after: list[Envelope] = []
    while not coord.seen.empty():
        after.append(coord.seen.get_nowait())
    assert not any(isinstance(e.body, Reply) and e.body.task_id == "r1.2.dev1" for e in after)
    statuses = [e.body for e in after if isinstance(e.body, Status)]
    assert statuses and statuses[-1].state == "offline", statuses
    # the checkpoint is round 1's, whole and loadable without pickle
    checkpoint = tmp_path / "dev1" / "checkpoint.pt"
    assert load_checkpoint(checkpoint).meta["round"] == 1
    torch.load(checkpoint, weights_only=True)
