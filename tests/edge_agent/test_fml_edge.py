"""FML edge half: the mutual-learning loss against hand-computed values, teachers detached, the
meme shared fleet-wide across private architectures and the only module that travels."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import coordinator.strategies.fml  # noqa: F401  (registers the server half)
from edge_agent.algorithms import EdgeContext
from edge_agent.algorithms.fml import FMLEdge
from edge_agent.distillation import mutual_kl
from edge_agent.trainer import TensorData
from models import create_model
from protocol.algorithms.fml import FMLConfig
from protocol.contract.messages import Task
from protocol.contract.payloads import Payload, TensorMap

C = 3
KL = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)  # KL([.75,.25] || [.5,.5])


def test_mutual_kl_per_sample_or_per_element() -> None:
    student, teacher = torch.zeros(1, 2), torch.tensor([[math.log(3.0), 0.0]])
    assert mutual_kl(student, teacher).item() == pytest.approx(KL, rel=1e-5)
    assert mutual_kl(student, teacher, "elementwise_mean").item() == pytest.approx(KL / 2, rel=1e-5)


def make_edge(arch: str = "cnn_t1", seed: int = 0) -> FMLEdge:
    g = torch.Generator().manual_seed(1)
    y = torch.arange(C).repeat(6)
    x = torch.rand(len(y), 1, 8, 8, generator=g)
    torch.manual_seed(seed)
    ctx = EdgeContext(
        model=create_model(arch, num_classes=C, in_chans=1, feature_dim=4, input_size=8),
        train=TensorData(x, y),
        test=TensorData(x[:6], y[:6]),
        num_classes=C,
        device=torch.device("cpu"),
        generator=torch.Generator().manual_seed(seed),
    )
    return FMLEdge(ctx)


def task(payloads: dict[str, Payload] | None = None, **cfg: object) -> Task:
    return Task(
        task_id="t",
        run_id="r",
        round=1,
        phase="train",
        deadline=0.0,
        algorithm="fml",
        config=FMLConfig(batch_size=8).replace(**cfg).to_dict(),
        payloads=payloads or {},
    )


def test_step_loss_is_both_weighted_objectives() -> None:
    edge = make_edge()
    edge.cfg = FMLConfig(alpha=0.3, beta=0.8)
    x, y = torch.rand(5, 1, 8, 8), torch.tensor([0, 1, 2, 0, 1])
    logits = edge.ctx.model(x)
    zm = edge.shared_net()(x)
    p, q = F.softmax(logits, 1), F.softmax(zm, 1)
    kl_meme_to_private = (q * (q.log() - p.log())).sum(1).mean()  # KL(p_meme || p_private)
    kl_private_to_meme = (p * (p.log() - q.log())).sum(1).mean()
    expected = (
        0.3 * F.cross_entropy(logits, y)
        + 0.7 * kl_meme_to_private
        + 0.8 * F.cross_entropy(zm, y)
        + 0.2 * kl_private_to_meme
    )
    got = edge.step_loss(x, y, edge.ctx.model.forward_features(x), logits)
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)


def test_each_model_gets_the_gradient_of_its_own_loss_only() -> None:
    edge = make_edge()
    edge.cfg = FMLConfig(alpha=0.5, beta=0.5)
    x, y = torch.rand(5, 1, 8, 8), torch.tensor([0, 1, 2, 0, 1])
    meme = edge.shared_net()
    logits, zm = edge.ctx.model(x), meme(x)
    edge.step_loss(x, y, logits, logits).backward()
    summed = [p.grad.clone() for p in meme.parameters()]  # type: ignore[union-attr]
    meme.zero_grad()
    logits, zm = edge.ctx.model(x), meme(x)
    own = 0.5 * F.cross_entropy(zm, y) + 0.5 * mutual_kl(zm, logits)
    own.backward()
    for a, p in zip(summed, meme.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad)


def test_the_meme_starts_identical_across_private_architectures_and_alone_travels() -> None:
    a, b = make_edge("cnn_t1", seed=0), make_edge("mlp_s", seed=1)
    up = a.handle(task()).payloads["weights"]
    b.handle(task(local_epochs=0))
    assert isinstance(up, TensorMap)
    meme = a.shared_net().state_dict()  # the upload is the meme, not the private cnn_t1
    assert sorted(up.tensors) == sorted(meme)
    for k, v in meme.items():
        np.testing.assert_array_equal(v.numpy(), up.tensors[k])
    # b trained no step: its meme is the fleet-wide init, which a's started from too
    fresh = make_edge("cnn_t1", seed=5)
    fresh.handle(task(local_epochs=0))
    for k, v in b.shared_net().state_dict().items():
        torch.testing.assert_close(v, fresh.shared_net().state_dict()[k])
    b.receive({"weights": up})
    for k, v in b.shared_net().state_dict().items():
        np.testing.assert_array_equal(v.numpy(), up.tensors[k])


def test_training_reports_the_shared_model_accuracy() -> None:
    result = make_edge().handle(task())
    assert 0.0 <= result.metrics["shared_acc"] <= 1.0
    assert 0.0 <= result.metrics["global_shared_acc"] <= 1.0


def test_with_teacher_grad_each_model_also_gets_the_other_kl_term() -> None:
    edge = make_edge()
    edge.cfg = FMLConfig(alpha=0.5, beta=0.5, teacher_grad=True)
    x, y = torch.rand(5, 1, 8, 8), torch.tensor([0, 1, 2, 0, 1])
    meme = edge.shared_net()
    logits = edge.ctx.model(x)
    edge.step_loss(x, y, logits, logits).backward()
    summed = [p.grad.clone() for p in meme.parameters()]  # type: ignore[union-attr]
    meme.zero_grad()
    logits, zm = edge.ctx.model(x), meme(x)
    own = 0.5 * F.cross_entropy(zm, y) + 0.5 * mutual_kl(zm, logits)
    other = 0.5 * F.kl_div(F.log_softmax(logits, 1), F.softmax(zm, 1), reduction="batchmean")
    (own + other).backward()  # HtFLlib's path: the private model's KL reaches the meme too
    for a, p in zip(summed, meme.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad)
    meme.zero_grad()
    own = 0.5 * F.cross_entropy(meme(x), y) + 0.5 * mutual_kl(meme(x), edge.ctx.model(x))
    own.backward()
    grads = [p.grad for p in meme.parameters()]
    assert any(
        not torch.allclose(a, g) for a, g in zip(summed, grads, strict=True) if g is not None
    )
