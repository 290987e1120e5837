"""A registration's two forms: the label histogram, or only the class set and size."""

from __future__ import annotations

from typing import Any

import pytest

from protocol.contract import lean
from protocol.contract.codec import Envelope, decode, encode
from protocol.contract.messages import Capabilities, CoordinatorState, InputSpec, Register
from protocol.errors import ProtocolError, ValidationError


def _register(**form: Any) -> Register:
    return Register(
        device_id="d",
        arch="mlp_s",
        num_params=1,
        capabilities=Capabilities(device="cpu"),
        input_spec=InputSpec(1, 8, 8),
        num_classes=4,
        algorithm="fedproto",
        **form,
    )


def test_the_class_set_form_travels_without_counts_and_both_decoders_agree() -> None:
    reg = _register(classes=[0, 3], num_samples=17)
    body = reg.to_wire()
    assert "class_counts" not in body and body["classes"] == [0, 3]
    assert decode(encode(Envelope(body=reg, sender="d"))).body == reg
    assert lean.decode_body("register", body) == reg
    assert (reg.present_classes(), reg.total_samples(), reg.counts_by_class()) == ([0, 3], 17, {})
    assert not reg.discloses_counts


def test_the_histogram_form_encodes_as_before_without_the_new_fields() -> None:
    reg = _register(class_counts={"0": 5, "3": 12})
    body = reg.to_wire()
    assert "classes" not in body and "num_samples" not in body
    assert (reg.present_classes(), reg.total_samples()) == ([0, 3], 17)
    assert reg.discloses_counts


@pytest.mark.parametrize(
    ("form", "field"),
    [
        ({"class_counts": {"0": 5}, "classes": [0], "num_samples": 5}, "classes"),
        ({"classes": [3, 0], "num_samples": 5}, "classes"),
        ({"classes": [0, 0], "num_samples": 5}, "classes"),
        ({"classes": [4], "num_samples": 5}, "classes"),
        ({"classes": [0, 1], "num_samples": 1}, "num_samples"),
    ],
)
def test_a_bad_class_set_is_refused_naming_the_field(form: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        _register(**form)
    assert info.value.field == field
    body = _register(classes=[0], num_samples=5).to_wire() | {
        k: v for k, v in form.items() if k != "class_counts"
    }
    body |= {"class_counts": form["class_counts"]} if "class_counts" in form else {}
    assert lean.decode_body("register", body) is None
    with pytest.raises(ProtocolError):
        Register.from_wire(body, "register")


def test_the_state_asks_for_the_histogram_unless_it_says_otherwise() -> None:
    state = CoordinatorState(state="running", run_id="r", algorithm="a", round=0, total_rounds=1)
    assert state.class_counts and "class_counts" not in state.to_wire()
    asked = CoordinatorState.from_wire(state.to_wire() | {"class_counts": False})
    assert not asked.class_counts


def test_the_state_carries_the_budget_to_noise_the_histogram_by_only_under_dp() -> None:
    plain = CoordinatorState(state="running", run_id="r", algorithm="fd", round=0, total_rounds=2)
    assert not [k for k in plain.to_wire() if k.startswith("dp_")]  # bytes as before DP
    budget = {"dp_epsilon": 2.0, "dp_delta": 1e-5, "dp_releases": 2}
    noised = CoordinatorState.from_wire(plain.to_wire() | budget)
    assert (noised.dp_epsilon, noised.dp_delta, noised.dp_releases) == (2.0, 1e-5, 2)
    for bad in ({"dp_epsilon": -1.0}, {"dp_epsilon": 2.0, "dp_delta": 1.0, "dp_releases": 2},
                {"dp_epsilon": 2.0, "dp_delta": 1e-5}):  # fmt: skip
        with pytest.raises(ValidationError, match="dp_"):
            CoordinatorState.from_wire(plain.to_wire() | bad)
