"""Felo/Velo/FedHe edge half: Eq. (1) against hand-computed values, masking of classes without
knowledge, statistics from the training forward passes, the group model taken as sent."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from edge_agent.algorithms import EdgeContext
from edge_agent.algorithms.felo import FeloEdge, VeloEdge, felo_kd_loss
from edge_agent.class_stats import ClassReservoir
from edge_agent.trainer import TensorData
from models import Classifier, create_model
from protocol.algorithms import config_type
from protocol.contract.messages import Task
from protocol.contract.payloads import FeatureLogitSet, LabelledVectors, Payload, TensorMap
from protocol.errors import ValidationError

C, D = 3, 4
KL = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)  # KL([.75,.25] || [.5,.5])


def test_kd_loss_matches_hand_computed_mse_and_kl() -> None:
    s, target = torch.tensor([[1.0, 2.0]]), torch.zeros(1, 2)
    p, target_p = torch.zeros(1, 2), torch.tensor([[math.log(3.0), 0.0]])  # softmax: .75/.25
    assert felo_kd_loss(s, p, target, target_p, True, False).item() == pytest.approx(2.5)
    # the authors' elementwise mean divides the per-sample KL by C = 2
    kl_mean = felo_kd_loss(s, p, target, target_p, False, True).item()
    assert kl_mean == pytest.approx(KL / 2, rel=1e-5)
    kl_batch = felo_kd_loss(s, p, target, target_p, False, True, "batchmean").item()
    assert kl_batch == pytest.approx(KL, rel=1e-5)
    both = felo_kd_loss(s, p, target, target_p).item()
    assert both == pytest.approx(2.5 + KL / 2, rel=1e-5)


def make_edge(seed: int = 0, kind: type[FeloEdge] = FeloEdge) -> FeloEdge:
    g = torch.Generator().manual_seed(1)
    y = torch.tensor([0, 2]).repeat_interleave(10)  # the client holds classes 0 and 2
    x = torch.rand(len(y), 1, 8, 8, generator=g)
    torch.manual_seed(seed)

    def build() -> Classifier:
        return create_model("mlp_s", num_classes=C, in_chans=1, feature_dim=D, input_size=8)

    net = build()
    ctx = EdgeContext(
        model_builder=build,
        model=net,
        train=TensorData(x, y),
        test=TensorData(x[:4], y[:4]),
        num_classes=C,
        device=torch.device("cpu"),
        generator=torch.Generator().manual_seed(seed),
    )
    return kind(ctx)


def task(
    payloads: dict[str, Payload] | None = None, algorithm: str = "felo", **cfg: object
) -> Task:
    config = config_type(algorithm)(local_epochs=1, batch_size=8).replace(**cfg)
    return Task(
        task_id="t",
        run_id="r",
        round=2,
        phase="train",
        deadline=0.0,
        algorithm=algorithm,
        config=config.to_dict(),
        payloads=payloads or {},
    )


def knowledge(ids: list[int]) -> FeatureLogitSet:
    m = len(ids)
    return FeatureLogitSet(
        np.array(ids, np.int32),
        np.ones((m, D), np.float32),
        np.zeros((m, C), np.float32),
        np.ones(m, np.int32),
    )


def test_uploaded_means_are_those_of_the_training_forward_passes() -> None:
    # Prepare: record every forward pass the loop makes, before each update
    edge = make_edge()
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    loss_of_step = edge.step_loss

    def spy(x, y, features, logits):  # type: ignore[no-untyped-def]
        seen.append((y.clone(), features.detach().clone(), logits.detach().clone()))
        return loss_of_step(x, y, features, logits)

    edge.step_loss = spy  # type: ignore[method-assign]
    # Execute
    result = edge.handle(task())
    # Assert: the upload is the per-class mean of exactly those passes (no second pass)
    k = result.payloads["knowledge"]
    assert isinstance(k, FeatureLogitSet)
    assert k.class_ids.tolist() == [0, 2] and k.counts.tolist() == [10, 10]
    y = torch.cat([s[0] for s in seen])
    f = torch.cat([s[1] for s in seen])
    p = torch.cat([s[2] for s in seen])
    for i, c in enumerate([0, 2]):
        np.testing.assert_allclose(k.features[i], f[y == c].mean(0).numpy(), rtol=1e-5)
        np.testing.assert_allclose(k.logits[i], p[y == c].mean(0).numpy(), rtol=1e-5)
    assert isinstance(result.payloads["weights"], TensorMap)


def test_kd_terms_only_for_samples_whose_class_has_knowledge() -> None:
    edge = make_edge()
    edge.handle(task({"knowledge": knowledge([2])}))  # class 0 has no server knowledge
    assert edge.valid.tolist() == [False, False, True]
    x = torch.rand(4, 1, 8, 8)
    feats = edge.ctx.model.forward_features(x)
    logits = edge.ctx.model.forward_head(feats)
    y0 = torch.zeros(4, dtype=torch.long)
    ce = torch.nn.functional.cross_entropy(logits, y0)
    assert edge.step_loss(x, y0, feats, logits).item() == pytest.approx(ce.item())
    y2 = torch.full((4,), 2, dtype=torch.long)
    ce2 = torch.nn.functional.cross_entropy(logits, y2)
    assert edge.step_loss(x, y2, feats, logits).item() > ce2.item()  # KD term added


def test_warm_up_task_without_knowledge_clears_it() -> None:
    edge = make_edge()
    edge.handle(task({"knowledge": knowledge([0, 2])}))
    edge.handle(task())
    assert not edge.valid.any()


def test_the_group_model_is_loaded_as_sent() -> None:
    a, b = make_edge(seed=0), make_edge(seed=1)
    sent = a.handle(task())  # a's trained model is what the coordinator would send b
    w = sent.payloads["weights"]
    assert isinstance(w, TensorMap)
    b.receive({"weights": w})
    for name, t in b.ctx.model.state_dict().items():
        np.testing.assert_array_equal(t.numpy(), w.tensors[name])


def test_knowledge_of_the_wrong_shape_is_refused() -> None:
    edge = make_edge()
    bad = FeatureLogitSet(
        np.array([0], np.int32), np.ones((1, D + 1)), np.zeros((1, C)), np.ones(1, np.int32)
    )
    with pytest.raises(ValidationError, match="features of dim 4"):
        edge.receive({"knowledge": bad})


def test_a_reservoir_keeps_a_uniform_sample_of_each_class_on_its_own_stream() -> None:
    # Prepare: 1,000 vectors of class 0 (value = their index) and 3 of class 1
    other = torch.Generator().manual_seed(5)
    before = other.get_state()
    counts = torch.zeros(1000)
    for trial in range(200):
        r = ClassReservoir(2, 10, torch.Generator().manual_seed(trial))
        for start in range(0, 1000, 10):
            r.add(torch.arange(start, start + 10.0).unsqueeze(1), torch.zeros(10, dtype=torch.long))
        r.add(torch.ones(3, 1), torch.ones(3, dtype=torch.long))
        out = r.payload(dim=1)
        assert out.labels.tolist() == [0] * 10 + [1] * 3  # at most 10 a class, all of a few
        counts[torch.as_tensor(out.vectors[:10, 0]).long()] += 1
    # Assert: every vector kept about as often (expected 200 x 10 / 1000 = 2 per vector):
    # the first and the last hundred alike
    assert (
        abs(float(counts[:100].mean()) - 2.0) < 0.5 and abs(float(counts[-100:].mean()) - 2.0) < 0.5
    )
    assert torch.equal(other.get_state(), before)


def test_velo_uploads_a_sample_of_its_training_features_only_when_asked() -> None:
    edge = make_edge(kind=VeloEdge)
    assert "samples" not in edge.handle(task(algorithm="velo")).payloads
    out = edge.handle(task(algorithm="velo", upload_samples=3)).payloads
    s = out["samples"]
    assert isinstance(s, LabelledVectors)
    assert s.labels.tolist() == [0, 0, 0, 2, 2, 2] and s.vectors.shape == (6, D)
    k = out["knowledge"]
    assert isinstance(k, FeatureLogitSet) and k.class_ids.tolist() == [0, 2]
