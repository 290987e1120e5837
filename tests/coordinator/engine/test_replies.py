"""``coordinator.engine.replies``: acks spliced from a template are the acks ``encode`` makes;
a refused reply fails its device only when its frame verified."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import fake_agent
from hypothesis import given
from hypothesis import strategies as st

from coordinator.engine.replies import AckFrames, ReplyDesk
from coordinator.store.database import Store
from coordinator.strategies import Step, create_strategy
from protocol.algorithms import config_type
from protocol.contract.codec import Envelope, decode, encode
from protocol.contract.messages import Ack, Reply
from protocol.contract.payloads import PrototypeSet
from protocol.security.signing import HmacSigner, Verifier
from protocol.transport.base import MemoryBroker, MemoryTransport
from protocol.transport.endpoint import Endpoint

SIGNER = HmacSigner("coordinator", b"k" * 32)
IDS = st.text(st.characters(blacklist_categories=["Cs"]), min_size=1, max_size=80)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _endpoint(signed: bool = False) -> Endpoint:
    t = MemoryTransport(MemoryBroker(), "coord")
    t.connect()
    signer = SIGNER if signed else None
    return Endpoint(t, sender="coordinator", federation="fed", signer=signer)


@given(ref_id=IDS, task_id=IDS)
def test_an_accepted_ack_is_the_frame_encode_makes_of_its_envelope(
    ref_id: str, task_id: str
) -> None:
    frames = AckFrames(_endpoint())
    ack = Ack(ref_id=ref_id, task_id=task_id)
    frame = frames.unsigned(ack)
    env = decode(frame)
    assert env.body == ack
    assert (env.sender, env.federation, env.round) == ("coordinator", "fed", 0)
    assert frame == encode(replace(env, wire=b""))  # canonical: byte for byte encode's


@pytest.mark.parametrize(
    "ack",
    [
        Ack(ref_id="m1", task_id="t1", accepted=False, reason="late or unknown task"),
        Ack(ref_id="m1"),  # no task id: the field is left out of the frame
    ],
)
def test_refusals_and_acks_without_a_task_are_encoded_as_usual(ack: Ack) -> None:
    frames = AckFrames(_endpoint())
    env = decode(frames.unsigned(ack))
    assert env.body == ack
    assert frames._template is None  # never made for these


def test_each_frame_has_its_own_message_id_and_the_template_is_renewed_with_age() -> None:
    clock = Clock()
    frames = AckFrames(_endpoint(), max_age_s=1.0, clock=clock)
    first, second = (decode(frames.unsigned(Ack(ref_id=f"m{i}", task_id="t"))) for i in (1, 2))
    assert first.msg_id != second.msg_id
    assert first.ts == second.ts  # one template
    template = frames._template
    clock.now += 0.5
    frames.unsigned(Ack(ref_id="m3", task_id="t"))
    assert frames._template is template
    clock.now += 0.6  # 1.1 s after it was made: a fresh timestamp for the replay window
    later = decode(frames.unsigned(Ack(ref_id="m4", task_id="t")))
    assert frames._template is not template
    assert later.ts >= first.ts


def test_a_sealed_spliced_ack_verifies_as_the_coordinators() -> None:
    endpoint = _endpoint(signed=True)
    frame = endpoint.seal(AckFrames(endpoint).unsigned(Ack(ref_id="m1", task_id="t1")))
    env = Verifier({"coordinator": SIGNER.verify_key()}).verify(frame)
    assert env.body == Ack(ref_id="m1", task_id="t1")


@pytest.mark.parametrize("verified", [False, True])
def test_only_a_verified_invalid_reply_fails_its_device(verified: bool, tmp_path: Path) -> None:
    # Prepare: a fedproto desk; a reply of the open step's task with a class never registered
    strategy = create_strategy("fedproto", config_type("fedproto")(), num_classes=10)
    store = Store(tmp_path / "state.sqlite")
    agent = fake_agent("a0", "fedproto", {0: 5, 1: 5})
    protos = PrototypeSet(np.array([7]), np.ones((1, 4), np.float32), np.array([5]))
    reply = Reply(task_id="t", round=1, phase="train", num_samples=5, payloads={"protos": protos})
    env = Envelope(body=reply, sender="a0", verified=verified)
    # Execute
    try:
        verdict = ReplyDesk(strategy, store).judge(env, reply, Step(1, "train"), "t", agent)
    finally:
        store.close()
    # Assert: refused either way; only a verified frame closes the device's slot
    assert verdict.ack is not None and not verdict.ack.accepted
    assert verdict.reject is not None and verdict.reject[0] == "invalid_reply"
    assert (verdict.fail is not None) == verified


@pytest.mark.parametrize(
    ("metrics", "valid"),
    [
        ({"acc_val": 0.75, "acc_local": 1.0, "acc_global": 0.0, "loss_val": 7.5}, True),
        ({"acc_val": 1.5}, False),  # would outweigh every other agent of the round
        ({"acc_val": -0.1}, False),
        ({"acc_local": 2.0}, False),
    ],
)
def test_an_accuracy_outside_zero_to_one_is_refused(
    metrics: dict[str, float], valid: bool, tmp_path: Path
) -> None:
    strategy = create_strategy("fedproto", config_type("fedproto")(), num_classes=10)
    store = Store(tmp_path / "state.sqlite")
    agent = fake_agent("a0", "fedproto", {0: 5, 1: 5})
    protos = PrototypeSet(np.array([0]), np.ones((1, 4), np.float32), np.array([5]))
    reply = Reply(
        task_id="t",
        round=1,
        phase="train",
        num_samples=5,
        payloads={"protos": protos},
        metrics=metrics,
    )
    env = Envelope(body=reply, sender="a0", verified=True)
    try:
        verdict = ReplyDesk(strategy, store).judge(env, reply, Step(1, "train"), "t", agent)
    finally:
        store.close()
    assert verdict.store is valid
    if not valid:
        assert verdict.reject is not None and "an accuracy in [0, 1]" in verdict.reject[1]
