"""FML server half with fake replies (sample-weighted or uniform meme, one input spec, layout
checks); whole runs: test_every_algorithm.py."""

import numpy as np
import pytest
from helpers import fake_agent

import coordinator.strategies.fml  # noqa: F401  (registers the server half)
import edge_agent.algorithms.fml  # noqa: F401  (registers the edge half)
from coordinator.strategies import AgentInfo, Step, create_strategy
from protocol.algorithms.fml import FMLConfig
from protocol.contract.messages import Reply
from protocol.contract.payloads import TensorMap
from protocol.errors import AdmissionError, ValidationError

C = 3


def agent(device_id: str, arch: str, size: int = 8, algorithm: str = "fml") -> AgentInfo:
    counts = {0: 5, 1: 5}
    return fake_agent(
        device_id, algorithm, counts, num_classes=C, arch=arch, input_spec=(1, size, size)
    )


def meme(value: float, shape: tuple[int, ...] = (2, 2)) -> TensorMap:
    return TensorMap({"w": np.full(shape, value, np.float32), "n": np.array(4, np.int64)})


def reply(w: TensorMap, n: int) -> Reply:
    return Reply(task_id="t", round=1, phase="train", num_samples=n, payloads={"weights": w})


A, B = agent("a", "mlp_s"), agent("b", "cnn_t1")


@pytest.mark.parametrize(
    ("sample_weighted", "mean"),
    [(True, 3.0), (False, 2.5)],  # (10 x 1 + 20 x 4) / 30; uniform (1 + 4) / 2 (HtFLlib's)
)
def test_memes_average_by_sample_count_or_uniformly_across_private_architectures(
    sample_weighted: bool, mean: float
) -> None:
    s = create_strategy("fml", FMLConfig(sample_weighted=sample_weighted), num_classes=C)
    s.admit(B, [A])
    replies = [(A, reply(meme(1.0), 10)), (B, reply(meme(4.0), 20))]
    s.aggregate(Step(1, "train"), replies)
    sent = s.configure(Step(2, "train"), A)["weights"]
    assert isinstance(sent, TensorMap)
    np.testing.assert_allclose(sent.tensors["w"], np.full((2, 2), mean))
    assert int(sent.tensors["n"]) == 4  # integer buffers: the maximum


def test_another_input_is_refused_at_admission_and_another_meme_left_out_of_round_one() -> None:
    s = create_strategy("fml", FMLConfig(), num_classes=C)
    with pytest.raises(AdmissionError, match="1x16x16"):
        s.admit(agent("x", "mlp_s", size=16), [A])
    # round 1: no upload fixes the layout; the one most uploads share is averaged
    odd = agent("odd", "mlp_s")
    replies = [(A, reply(meme(1.0), 10)), (odd, reply(meme(9.0, (3,)), 10))]
    replies.append((B, reply(meme(4.0), 20)))
    for a, r in replies:
        s.validate(Step(1, "train"), a, r)
    metrics = s.aggregate(Step(1, "train"), replies)
    assert metrics["layout_outliers"] == 1.0 and metrics["aggregated"] == 2.0
    sent = s.configure(Step(2, "train"), A)["weights"]
    assert isinstance(sent, TensorMap)
    np.testing.assert_allclose(sent.tensors["w"], np.full((2, 2), 3.0))  # A and B only
    with pytest.raises(ValidationError, match="global model"):
        s.validate(Step(2, "train"), odd, reply(meme(1.0, (3,)), 10))


class CrashOnceError(RuntimeError):
    pass


def test_a_resumed_run_names_client0s_architecture_in_the_resumed_steps_tasks(
    tmp_path, monkeypatch, caplog
) -> None:
    # Prepare: an FML run whose shared model is client 0's architecture; the coordinator dies
    # having opened round 2's step but before its tasks, the agents restart (a power cut),
    # and a new coordinator resumes that step
    from coordinator.engine.core import Coordinator
    from protocol.transport.base import MemoryBroker
    from tests.helpers_runtime import InProcessAgent, crash_and_resume, run_config

    cfg = run_config(tmp_path, "fml", rounds=2)
    cfg = cfg.replace(hyper={**cfg.hyper, "shared_model": "client0_arch"})
    broker = MemoryBroker()
    agents = [InProcessAgent(cfg, broker, i).start() for i in range(3)]
    original = Coordinator.collect
    crashed: list[int] = []

    def collect(self: Coordinator, rec, step):  # type: ignore[no-untyped-def]
        if step.round == 2 and not crashed:
            crashed.append(1)
            raise CrashOnceError
        return original(self, rec, step)

    monkeypatch.setattr(Coordinator, "collect", collect)
    successor = crash_and_resume(cfg, broker, CrashOnceError)
    for a in agents:
        a.kill()
        a.start()  # from its checkpoint: it builds its shared model from the task's config
    # Execute
    result = successor.run()
    # Assert: every agent trained every round, and no task failed on arrival for naming
    # `client0_arch` (the step's retry would have named the architecture: too late, and on a
    # fleet where some replies were in, only after the step's deadline)
    assert [sorted(m["agents"]) for m in result.metrics] == [["agent0", "agent1", "agent2"]] * 3
    assert "client0_arch" not in caplog.text
    for a in agents:
        a.close()
