"""``docs/concepts/security.md`` item 5: a declared ``feature_dim`` decides the dimension
of
prototypes and features, so a forger who answers first in round 1 cannot pin its own and get
the honest replies of that round refused. Without one, round 1 takes the size most of the
step's participants registered (``Register.feature_dim``), never a reply's."""

import dataclasses

import numpy as np
import pytest
from helpers import fake_agent

from coordinator.strategies import AgentInfo, Step, create_strategy
from protocol.algorithms import config_type
from protocol.contract.messages import Reply
from protocol.contract.payloads import FeatureLogitSet, PrototypeSet
from protocol.errors import ConfigError, ValidationError

ROUND1 = Step(1, "train")


def agent(device_id: str, algorithm: str) -> AgentInfo:
    return fake_agent(device_id, algorithm, {0: 5, 1: 5})


def registered(device_id: str, algorithm: str, feature_dim: int) -> AgentInfo:
    info = agent(device_id, algorithm)
    return AgentInfo(device_id, dataclasses.replace(info.register, feature_dim=feature_dim))


def protos(dim: int) -> Reply:
    sd = np.ones(dim, np.float32)
    p = PrototypeSet(np.array([0, 1]), np.ones((2, dim), np.float32), np.array([5, 5]), sd=sd)
    return Reply(task_id="t", round=1, phase="train", num_samples=10, payloads={"protos": p})


def knowledge(dim: int) -> Reply:
    k = FeatureLogitSet(
        np.array([0]), np.ones((1, dim), np.float32), np.zeros((1, 4), np.float32), np.array([5])
    )
    return Reply(task_id="t", round=1, phase="train", num_samples=10, payloads={"knowledge": k})


def strategy(name: str, **hyper: object):
    extra = {"same_arch_avg": False} if name == "felo" else {}
    return create_strategy(name, config_type(name).from_dict({**extra, **hyper}), num_classes=4)


@pytest.mark.parametrize(
    ("name", "make", "field"),
    [
        ("fedproto", protos, "reply.payloads.protos.vectors"),
        ("fedvtc", protos, "reply.payloads.protos.vectors"),
        ("felo", knowledge, "reply.payloads.knowledge.features"),
    ],
)
def test_a_declared_dimension_refuses_the_forger_even_when_it_answers_first(
    name: str, make, field: str
) -> None:
    s = strategy(name, feature_dim=16)
    with pytest.raises(ValidationError, match=rf"{field}.*dimension 16.*7"):
        s.validate(ROUND1, agent("a1", name), make(7))  # the forger, first
    s.validate(ROUND1, agent("a0", name), make(16))  # the honest device, accepted


@pytest.mark.parametrize(("name", "make"), [("fedproto", protos), ("felo", knowledge)])
def test_without_a_declaration_the_registered_dimension_decides_round_1(name: str, make) -> None:
    s = strategy(name)
    fleet = [registered(f"a{i}", name, 16) for i in range(3)]
    s.observe_fleet(fleet)
    with pytest.raises(ValidationError, match="dimension 16"):
        s.validate(ROUND1, fleet[0], make(7))  # the forger, first: it fixes nothing
    s.validate(ROUND1, fleet[1], make(16))


def test_the_declaration_is_a_bounded_config_key() -> None:
    with pytest.raises(ConfigError, match="feature_dim must be in"):
        config_type("fedproto").from_dict({"feature_dim": 10**6})
    assert config_type("fedtgp")().feature_dim == 0  # FedTGP validates as FedProto does
