"""FedType's loss terms against hand-computed values (fedtype.md §4.2, §4.3, §3.4 FedProx)."""

from __future__ import annotations

import math

import pytest
import torch

from edge_agent.algorithms.fedtype import backward_kd, symmetric_kd
from edge_agent.distillation import forward_kd

LOG3 = math.log(3.0)
KL = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)  # KL([.75,.25] || [.5,.5])


def test_forward_kd_is_the_per_sample_kl_from_private_to_proxy() -> None:
    proxy = torch.zeros(2, 2, requires_grad=True)  # softmax .5/.5
    private = torch.tensor([[LOG3, 0.0], [LOG3, 0.0]], requires_grad=True)  # .75/.25
    loss = forward_kd(proxy, private)
    assert loss.item() == pytest.approx(KL, rel=1e-5)  # batch mean of two equal KLs, not / C
    loss.backward()
    assert private.grad is None  # the teacher is detached
    assert proxy.grad is not None and proxy.grad.abs().sum() > 0
    # temperature 2: softmax(w / 2) = [sqrt3, 1] / (1 + sqrt3); scaled by T^2 = 4
    q = math.sqrt(3) / (1 + math.sqrt(3))
    kl_t2 = q * math.log(q / 0.5) + (1 - q) * math.log((1 - q) / 0.5)
    assert forward_kd(proxy[:1], private[:1], 2.0).item() == pytest.approx(4 * kl_t2, rel=1e-5)


def test_symmetric_kd_takes_the_proxy_as_teacher() -> None:
    private = torch.zeros(1, 2, requires_grad=True)
    proxy = torch.tensor([[LOG3, 0.0]], requires_grad=True)
    loss = symmetric_kd(private, proxy)
    assert loss.item() == pytest.approx(KL, rel=1e-5)  # KL(softmax p || softmax w)
    loss.backward()
    assert proxy.grad is None and private.grad is not None


def sets(rows: list[list[int]], c: int = 3) -> torch.Tensor:
    out = torch.zeros(len(rows), c, dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, r] = True
    return out


def test_backward_kd_printed_form_hand_computed() -> None:
    # softmax([log 2, 0, 0]) = [.5, .25, .25]; S = {0, 1}, eta = .5
    z = torch.tensor([[math.log(2.0), 0.0, 0.0]])
    s, eta = sets([[0, 1]]), torch.tensor([0.5])
    expect = -0.5 * (math.log(0.5) + math.log(0.25))
    assert backward_kd(z, s, eta).item() == pytest.approx(expect, rel=1e-5)
    assert backward_kd(z, s, eta, "mean_over_set").item() == pytest.approx(expect / 2, rel=1e-5)
    # pairwise: each label of S against V = {2} only: log(2/3) and log(1/2)
    pair = -0.5 * (math.log(2 / 3) + math.log(0.5))
    assert backward_kd(z, s, eta, form="pairwise").item() == pytest.approx(pair, rel=1e-5)


def test_backward_kd_averages_over_the_batch_and_weights_by_eta() -> None:
    z = torch.zeros(2, 3)  # uniform: -log(1/3) per label of S
    s = sets([[0], [0, 1, 2]])
    loss = backward_kd(z, s, torch.tensor([1.0, 0.0]))
    assert loss.item() == pytest.approx(LOG3 / 2, rel=1e-5)  # second sample weighs nothing
    # S = all labels in pairwise form: nothing outside to beat, no loss
    assert backward_kd(z[1:], s[1:], torch.ones(1), form="pairwise").item() == pytest.approx(0.0)


def test_backward_kd_raises_the_mass_on_the_proxy_set() -> None:
    z = torch.zeros(1, 3, requires_grad=True)
    backward_kd(z, sets([[1]]), torch.ones(1)).backward()
    assert z.grad is not None
    assert z.grad[0, 1] < 0 < z.grad[0, 0]  # a gradient step raises logit 1, lowers the others
