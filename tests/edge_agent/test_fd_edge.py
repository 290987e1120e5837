"""FD edge half: the distillation term against hand-computed values, masking of classes without
a global logit, uploaded means from the training forward passes themselves."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import edge_context

import coordinator.strategies.fd  # noqa: F401  (registers the server half)
from edge_agent.algorithms.fd import FDEdge, fd_kd_loss
from models import create_model
from protocol.algorithms.fd import FDConfig
from protocol.contract.messages import Task
from protocol.contract.payloads import Payload, PrototypeSet
from protocol.errors import ValidationError

C = 3


def test_mse_term_divides_the_masked_squared_error_by_every_element() -> None:
    z = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    t = torch.tensor([[0.0, 2.0, 5.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([True, False])
    # (1 + 0 + 4) / (2 * 3): the unmasked row counts in the mean as HtFLlib's does
    assert fd_kd_loss(z, t, mask, "mse").item() == pytest.approx(5 / 6)


def test_soft_ce_term_against_softmax_of_the_global_logit() -> None:
    z = torch.zeros(2, 2)  # log softmax = log(1/2) everywhere
    t = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0]])  # softmax: 3/4, 1/4
    mask = torch.tensor([True, False])
    assert fd_kd_loss(z, t, mask, "soft_ce").item() == pytest.approx(math.log(2) / 2, rel=1e-6)


def make_edge(seed: int = 0) -> FDEdge:
    g = torch.Generator().manual_seed(1)
    y = torch.tensor([0, 2]).repeat_interleave(10)  # the client holds classes 0 and 2
    x = torch.rand(len(y), 1, 8, 8, generator=g)
    torch.manual_seed(seed)
    net = create_model("mlp_s", num_classes=C, in_chans=1, input_size=8)
    return FDEdge(edge_context(net, x, y, num_classes=C, test_size=4, seed=seed))


def task(payloads: dict[str, Payload] | None = None, **cfg: object) -> Task:
    return Task(
        task_id="t",
        run_id="r",
        round=2,
        phase="train",
        deadline=0.0,
        algorithm="fd",
        config=FDConfig(batch_size=8).replace(**cfg).to_dict(),
        payloads=payloads or {},
    )


def global_logits(rows: dict[int, list[float]]) -> PrototypeSet:
    ids = sorted(rows)
    return PrototypeSet(
        np.array(ids, np.int32),
        np.array([rows[c] for c in ids], np.float32),
        np.ones(len(ids), np.int32),
    )


def test_step_loss_adds_lambda_times_the_term_only_for_classes_with_a_global_logit() -> None:
    edge = make_edge()
    edge.handle(task({"logits": global_logits({2: [0.0, 1.0, 2.0]})}, kd_weight=0.5))
    assert edge.valid.tolist() == [False, False, True]
    x = torch.rand(4, 1, 8, 8)
    feats = edge.ctx.model.forward_features(x)
    logits = edge.ctx.model.forward_head(feats)
    y = torch.tensor([0, 2, 2, 0])
    ce = torch.nn.functional.cross_entropy(logits, y)
    rows = logits[[1, 2]] - torch.tensor([0.0, 1.0, 2.0])
    expected = ce + 0.5 * rows.pow(2).sum() / (4 * C)
    assert edge.step_loss(x, y, feats, logits).item() == pytest.approx(expected.item(), rel=1e-6)
    y0 = torch.zeros(4, dtype=torch.long)  # class 0 has no global logit: plain CE
    ce0 = torch.nn.functional.cross_entropy(logits, y0)
    assert edge.step_loss(x, y0, feats, logits).item() == pytest.approx(ce0.item())


def test_uploaded_means_are_those_of_the_training_forward_passes() -> None:
    edge = make_edge()
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    loss_of_step = edge.step_loss

    def spy(x, y, features, logits):  # type: ignore[no-untyped-def]
        seen.append((y.clone(), logits.detach().clone()))
        return loss_of_step(x, y, features, logits)

    edge.step_loss = spy  # type: ignore[method-assign]
    result = edge.handle(task(local_epochs=2))
    up = result.payloads["logits"]
    assert isinstance(up, PrototypeSet) and set(result.payloads) == {"logits"}
    assert up.class_ids.tolist() == [0, 2] and up.counts.tolist() == [20, 20]  # two epochs
    y = torch.cat([s[0] for s in seen])
    p = torch.cat([s[1] for s in seen])
    for i, c in enumerate([0, 2]):
        np.testing.assert_allclose(up.vectors[i], p[y == c].mean(0).numpy(), rtol=1e-5)


def test_a_task_without_logits_clears_them_and_wrong_shapes_are_refused() -> None:
    edge = make_edge()
    edge.handle(task({"logits": global_logits({0: [0.0, 0.0, 0.0]})}))
    edge.handle(task())
    assert not edge.valid.any()
    with pytest.raises(ValidationError, match="vectors of 3 logits"):
        edge.receive({"logits": global_logits({0: [0.0, 0.0]})})
