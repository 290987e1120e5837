"""Declared reply payloads per algorithm and phase: unknown, missing and mistyped keys."""

import numpy as np
import pytest

from protocol.algorithms import config_type
from protocol.algorithms.base import PayloadSpec, check_payloads
from protocol.contract.payloads import PrototypeSet, TensorMap
from protocol.errors import ValidationError

SPECS = (PayloadSpec("protos", PrototypeSet), PayloadSpec("generator", TensorMap, required=False))


def protos() -> PrototypeSet:
    return PrototypeSet(np.array([0]), np.ones((1, 2), np.float32), np.array([1]))


def test_declared_payloads_pass_and_an_optional_one_may_be_absent() -> None:
    check_payloads(SPECS, {"protos": protos(), "generator": TensorMap({})}, "train")
    check_payloads(SPECS, {"protos": protos()}, "train")
    check_payloads((), {}, "final")


@pytest.mark.parametrize(
    ("payloads", "message"),
    [
        (
            {"protos": protos(), "extra": TensorMap({})},
            "reply.payloads.extra: expected one of ['generator', 'protos'] in phase train, "
            "got 'tensors'",
        ),
        ({}, "reply.payloads.protos: expected a protos payload (required in phase train)"),
        (
            {"protos": TensorMap({})},
            "reply.payloads.protos: expected a protos payload, got 'tensors'",
        ),
    ],
)
def test_unknown_missing_or_mistyped_payloads_name_the_field(payloads, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        check_payloads(SPECS, payloads, "train")
    assert str(info.value).startswith(message)


def test_a_phase_without_declared_payloads_accepts_none() -> None:
    with pytest.raises(ValidationError, match="no payload in phase final"):
        check_payloads((), {"protos": protos()}, "final")


@pytest.mark.parametrize(
    ("name", "phase", "keys"),
    [
        ("local", "train", []),
        ("fedavg", "train", ["weights"]),
        ("fedproto", "train", ["protos"]),
        ("fedvtc", "train", ["generator", "protos"]),
        ("fedvtc", "upload_generator", ["generator"]),
        ("fedvtc", "final", []),
    ],
)
def test_the_seed_algorithms_declare_their_replies(name: str, phase: str, keys: list[str]) -> None:
    specs = config_type(name).reply_payloads(phase)
    assert specs is not None and sorted(s.key for s in specs) == keys
