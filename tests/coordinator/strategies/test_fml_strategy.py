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
