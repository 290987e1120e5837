"""The codec's frame templates: spliced frames are byte-identical to encoded ones."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from msg_strategies import BUILDERS, envelopes

from protocol.contract.codec import Envelope, FrameTemplate, decode, encode
from protocol.contract.messages import Ack, Task

TASK = Task(
    task_id="t0",
    run_id="run",
    round=3,
    phase="train",
    deadline=1e9,
    algorithm="fedproto",
    config={"lr": 0.01, "epochs": 1},
    shared=bytes(range(32)),
)
ENV = Envelope(body=TASK, sender="coordinator", federation="fed", round=3, ts=1.7e9)
MSG_IDS = st.from_regex(r"[0-9a-f]{1,128}", fullmatch=True)
TASK_IDS = st.text(st.characters(blacklist_categories=["Cs"]), min_size=1, max_size=128)


def _encoded(env: Envelope, msg_id: str, task_id: str) -> bytes:
    return encode(replace(env, msg_id=msg_id, body=replace(env.body, task_id=task_id)))


@given(envelopes(BUILDERS["task"]), st.lists(st.tuples(MSG_IDS, TASK_IDS), min_size=1, max_size=5))
def test_a_task_template_fills_the_frames_encode_makes(
    env: Envelope, filled: list[tuple[str, str]]
) -> None:
    template = FrameTemplate.of(env, ("task_id",))
    for msg_id, task_id in filled:
        assert template.fill(msg_id, task_id) == _encoded(env, msg_id, task_id)


@pytest.mark.parametrize("size", [1, 31, 32, 128])  # fixstr, str8 headers
def test_strings_of_every_header_size_splice_into_a_decodable_frame(size: int) -> None:
    template = FrameTemplate.of(ENV, ("task_id",))
    msg_id, task_id = "a" * size, "é" * size  # 2 bytes a character: str8 and str16
    frame = template.fill(msg_id, task_id)
    assert frame == _encoded(ENV, msg_id, task_id)
    got = decode(frame)
    assert (got.msg_id, got.body) == (msg_id, replace(TASK, task_id=task_id))


def test_two_slots_of_a_body_are_filled_in_the_order_given() -> None:
    env = Envelope(body=TASK, sender="coordinator", federation="fed", round=3, ts=1.0)
    template = FrameTemplate.of(env, ("run_id", "task_id"))  # not the fields' order in a frame
    frame = template.fill("m1", "the-run", "the-task")
    assert frame == encode(
        replace(env, msg_id="m1", body=replace(TASK, task_id="the-task", run_id="the-run"))
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (("round",), "not a str field"),
        (("nope",), "not a str field"),
        (("config",), "not a str field"),
    ],
)
def test_fields_that_cannot_be_spliced_are_refused(fields: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FrameTemplate.of(ENV, fields)


def test_a_field_with_a_default_splices_any_other_value_and_refuses_the_default() -> None:
    # Ack.reason == "" is left out of the frame: a spliced "" would not be canonical
    env = Envelope(body=Ack(ref_id="r", accepted=False), sender="coordinator", ts=1.0)
    template = FrameTemplate.of(env, ("ref_id", "reason"))
    frame = template.fill("m1", "ref", "late")
    assert frame == encode(
        replace(env, msg_id="m1", body=replace(env.body, ref_id="ref", reason="late"))
    )
    with pytest.raises(ValueError, match="default"):
        template.fill("m2", "ref", "")


def test_fill_needs_one_value_per_field() -> None:
    template = FrameTemplate.of(ENV, ("task_id",))
    with pytest.raises(ValueError, match="1 field values expected, got 2"):
        template.fill("m", "a", "b")
