"""FedKD edge half: the adaptive mutual-distillation loss against hand-computed values, its
weight taken without gradient, W_h trained but never sent."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import edge_context

import coordinator.strategies.fedkd  # noqa: F401  (registers the server half)
from edge_agent.algorithms.fedkd import FedKDEdge, adaptive_kd_loss
from models import create_model
from protocol.algorithms.fedkd import FedKDConfig
from protocol.contract.lowrank import compress, is_compressed
from protocol.contract.messages import Task
from protocol.contract.payloads import TensorMap

C = 3
KL = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)  # KL([.75,.25] || [.5,.5])
KL_REV = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)  # KL([.5,.5] || [.75,.25])


def test_adaptive_loss_divides_the_distillation_by_both_task_losses() -> None:
    mentor = torch.zeros(1, 2)  # softmax 1/2, 1/2: CE = log 2
    mentee = torch.tensor([[math.log(3.0), 0.0]])  # softmax 3/4, 1/4: CE = log(4/3) for y = 0
    y = torch.tensor([0])
    h_t, h_s = torch.tensor([[1.0, 3.0]]), torch.tensor([[0.0, 1.0]])  # MSE = (1 + 4) / 2
    ce = math.log(2) + math.log(4 / 3)
    expected = ce + (KL + KL_REV + 2.5) / ce
    got = adaptive_kd_loss(mentor, mentee, y, h_t, h_s).item()
    assert got == pytest.approx(expected, rel=1e-5)
    no_hidden = adaptive_kd_loss(mentor, mentee, y).item()
    assert no_hidden == pytest.approx(ce + (KL + KL_REV) / ce, rel=1e-5)


def test_the_adaptive_weight_carries_no_gradient() -> None:
    mentor = torch.tensor([[0.3, -0.2, 0.1]], requires_grad=True)
    mentee = torch.tensor([[0.5, 0.0, -0.5]])
    y = torch.tensor([1])
    adaptive_kd_loss(mentor, mentee, y).backward()
    ref = mentor.detach().clone().requires_grad_(True)
    w = 1.0 / float(F.cross_entropy(ref.detach(), y) + F.cross_entropy(mentee, y))
    p_s = F.softmax(mentee, 1)
    own = F.cross_entropy(ref, y) + w * (p_s * (p_s.log() - F.log_softmax(ref, 1))).sum()
    own.backward()
    torch.testing.assert_close(mentor.grad, ref.grad)


def test_with_teacher_grad_the_loss_is_htfllibs_two_objectives_undetached() -> None:
    # HtFLlib's clientkd backpropagates loss + loss_g: both KLs and twice the hidden term over
    # the undetached sum of the task losses, into both models
    mentor = torch.tensor([[0.3, -0.2, 0.1]], requires_grad=True)
    mentee = torch.tensor([[0.5, 0.0, -0.5]], requires_grad=True)
    h_t, h_s = torch.tensor([[1.0, 3.0]]), torch.tensor([[0.0, 1.0]])
    y = torch.tensor([1])
    adaptive_kd_loss(mentor, mentee, y, h_t, h_s, teacher_grad=True).backward()
    t, s = (
        mentor.detach().clone().requires_grad_(True),
        mentee.detach().clone().requires_grad_(True),
    )
    p_t, p_s = F.softmax(t, 1), F.softmax(s, 1)
    kl_ts = (p_s * (p_s.log() - p_t.log())).sum()  # KL(p_s || p_t): the mentor's term
    kl_st = (p_t * (p_t.log() - p_s.log())).sum()
    task = F.cross_entropy(t, y) + F.cross_entropy(s, y)
    (task + (kl_ts + kl_st + 2 * F.mse_loss(h_t, h_s)) / task).backward()
    torch.testing.assert_close(mentor.grad, t.grad)
    torch.testing.assert_close(mentee.grad, s.grad)


def make_edge(seed: int = 0) -> FedKDEdge:
    g = torch.Generator().manual_seed(1)
    y = torch.arange(C).repeat(6)
    x = torch.rand(len(y), 1, 8, 8, generator=g)
    torch.manual_seed(seed)
    net = create_model("cnn_t1", num_classes=C, in_chans=1, feature_dim=4, input_size=8)
    return FedKDEdge(edge_context(net, x, y, num_classes=C, test_size=6, seed=seed))


def task(payloads: dict[str, TensorMap] | None = None, **cfg: object) -> Task:
    return Task(
        task_id="t",
        run_id="r",
        round=1,
        phase="train",
        deadline=0.0,
        algorithm="fedkd",
        config=FedKDConfig(batch_size=8).replace(**cfg).to_dict(),
        payloads=payloads or {},
    )


def test_w_h_maps_mentee_to_mentor_features_trains_and_stays_home() -> None:
    edge = make_edge()
    edge.cfg = FedKDConfig()
    w_h = edge.hidden_map()
    assert tuple(w_h.weight.shape) == (4, edge.shared_net().num_features)
    before = w_h.weight.detach().clone()
    up = edge.handle(task()).payloads["weights"]
    assert not torch.equal(before, w_h.weight)  # W_h is a trained group
    assert isinstance(up, TensorMap)
    assert sorted(up.tensors) == sorted(edge.shared_net().state_dict())  # the mentee alone
    state = edge.extra_state()
    assert any(k.startswith("fedkd_wh.") for k in state)
    restored = make_edge(seed=3)
    restored.load_extra_state(state)
    restored.cfg = FedKDConfig()
    torch.testing.assert_close(restored.hidden_map().weight, w_h.weight)
    for k, v in edge.shared_net().state_dict().items():
        np.testing.assert_array_equal(restored.shared_net().state_dict()[k].numpy(), v.numpy())


def test_without_the_hidden_loss_there_is_no_w_h_group() -> None:
    edge = make_edge()
    edge.cfg = FedKDConfig(hidden_loss=False)
    assert [g.name for g in edge.param_groups()] == ["private", "shared"]


def test_the_mentee_travels_compressed_both_ways() -> None:
    # Prepare: a global mentee whose large matrices are rank 1, sent as factors
    edge = make_edge()
    edge.cfg = FedKDConfig()
    net = edge.shared_net()
    glob = {k: v.clone() for k, v in net.state_dict().items()}
    for k, v in glob.items():
        if v.dim() == 2 and min(v.shape) > 4:
            glob[k] = torch.outer(
                torch.linspace(-1, 1, v.shape[0]), torch.linspace(0, 1, v.shape[1])
            )
    packed = compress(TensorMap({k: v.numpy() for k, v in glob.items()}), 0.95)
    assert is_compressed(packed)
    # Execute: receive it, then one round at a tiny lr (the mentee stays nearly rank 1)
    edge.receive({"weights": packed})
    for k, v in glob.items():
        torch.testing.assert_close(net.state_dict()[k].float(), v.float(), atol=1e-5, rtol=1e-4)
    up = edge.handle(task({"weights": packed}, lr=1e-6)).payloads["weights"]
    whole = make_edge().handle(task({"weights": packed}, lr=1e-6, svd=False)).payloads["weights"]
    # Assert: the upload is factorised and smaller; without svd it is the state dict
    assert isinstance(up, TensorMap) and isinstance(whole, TensorMap)
    assert is_compressed(up) and up.num_bytes < whole.num_bytes / 2
    assert sorted(whole.tensors) == sorted(net.state_dict())
