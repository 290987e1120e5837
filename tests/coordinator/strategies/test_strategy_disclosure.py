"""Minimal disclosure at registration: every strategy either declares that it reads the label
histogram (``needs_class_counts``) or admits and serves agents that registered only their
class set and size."""

from __future__ import annotations

import inspect
import logging
import sys
from pathlib import Path
from typing import Any

import pytest

from coordinator.engine.admission import Admission
from coordinator.engine.liveness import Presence
from coordinator.strategies import STRATEGIES, AgentInfo, Strategy, create_strategy
from protocol.contract.messages import Capabilities, InputSpec, Register
from protocol.errors import AdmissionError
from protocol.transport.base import MemoryBroker, MemoryTransport
from protocol.transport.endpoint import Endpoint
from tests.helpers_runtime import run_config

NUM_CLASSES = 4


def _agent(device_id: str, algorithm: str, **form: Any) -> AgentInfo:
    reg = Register(
        device_id=device_id,
        arch="cnn_t1",
        num_params=10,
        capabilities=Capabilities(device="cpu"),
        input_spec=InputSpec(1, 8, 8),
        num_classes=NUM_CLASSES,
        algorithm=algorithm,
        **form,
    )
    return AgentInfo(device_id, reg)


def _admission(tmp_path: Path, name: str) -> tuple[Admission, Strategy[Any]]:
    cfg = run_config(tmp_path, algorithm=name, num_classes=NUM_CLASSES)
    strategy = create_strategy(name, cfg.algorithm_config(), num_classes=NUM_CLASSES, seed=0)
    transport = MemoryTransport(MemoryBroker(), "coordinator")
    transport.connect()
    endpoint = Endpoint(transport, sender="coordinator", federation=cfg.federation)
    log = logging.getLogger("test")
    admission = Admission(cfg, strategy, endpoint, Presence(), log=log, reject=lambda *_: None)
    return admission, strategy


def _reads_counts(cls: type[Any]) -> list[str]:
    """The modules of ``cls``'s strategy classes whose source reads a registered histogram."""
    modules = {k.__module__ for k in cls.__mro__ if k.__module__.startswith("coordinator.")}
    return sorted(m for m in modules if "counts_by_class" in inspect.getsource(sys.modules[m]))


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_strategy_reads_the_histogram_only_if_it_declares_it(name: str) -> None:
    cls = STRATEGIES[name]
    assert bool(_reads_counts(cls)) == cls.needs_class_counts, _reads_counts(cls)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_admits_class_set_registrations_unless_it_declares_counts(
    tmp_path: Path, name: str
) -> None:
    # Prepare: two agents that registered only their class set and size
    admission, strategy = _admission(tmp_path, name)
    agents = [
        _agent("a0", name, classes=[0, 1], num_samples=40),
        _agent("a1", name, classes=[2, 3], num_samples=25),
    ]
    if strategy.needs_class_counts:
        # Execute + Assert: refused with the reason, and the histogram form is admitted
        with pytest.raises(AdmissionError, match="class_counts"):
            admission.check(agents[0])
        admission.check(_agent("a0", name, class_counts={"0": 30, "1": 10}))
        return
    # Execute: admitted one after the other, then the first step's tasks are configured
    for agent in agents:
        admission.check(agent)
        admission.agents[agent.device_id] = agent
    step = strategy.plan(2)[0]
    strategy.observe_fleet(agents)
    configured = [strategy.configure(step, agent) for agent in agents]
    # Assert: what the engine's checks read comes from the class set
    assert [a.classes for a in agents] == [[0, 1], [2, 3]]
    assert [a.num_samples for a in agents] == [40, 25]
    assert all(isinstance(c, dict) for c in configured)
