"""``docs/concepts/security.md`` "value bounds, every algorithm": the engine bounds every
reply's floats before the strategy sees it, so an algorithm whose ``validate`` checks only
shapes and classes (Felo's knowledge) cannot store a 5e4 feature either."""

from pathlib import Path

import numpy as np
import pytest

from coordinator.engine.runner import make_coordinator
from coordinator.strategies import AgentInfo, Step
from protocol.contract.messages import Capabilities, InputSpec, Register, Reply
from protocol.contract.payloads import FeatureLogitSet
from protocol.errors import ValidationError
from protocol.transport.base import MemoryBroker, MemoryTransport
from tests.helpers_runtime import run_config


def felo_reply(value: float) -> Reply:
    k = FeatureLogitSet(
        np.array([0]), np.full((1, 8), value, np.float32), np.zeros((1, 10), np.float32), [5]
    )
    return Reply(task_id="t", round=1, phase="train", num_samples=5, payloads={"knowledge": k})


def test_the_engine_bounds_values_the_strategy_does_not_look_at(tmp_path: Path) -> None:
    cfg = run_config(tmp_path, "felo").replace(hyper={"same_arch_avg": False})
    coordinator = make_coordinator(cfg, MemoryTransport(MemoryBroker(), "coordinator"))
    reg = Register(
        device_id="a0",
        arch="cnn_t1",
        num_params=10,
        capabilities=Capabilities(device="cpu"),
        input_spec=InputSpec(1, 8, 8),
        num_classes=10,
        class_counts={"0": 5},
        algorithm="felo",
    )
    agent, step = AgentInfo("a0", reg), Step(1, "train")
    try:
        coordinator.strategy.validate(step, agent, felo_reply(5e4))  # shapes and classes only
        with pytest.raises(ValidationError, match=r"knowledge\.features.*\|value\| <= 10000"):
            coordinator.desk.check(step, agent, felo_reply(5e4))
        coordinator.desk.check(step, agent, felo_reply(5.0))
    finally:
        coordinator.store.close()
