"""LG-FedAvg edge half: only the head travels, it starts identical across architectures, the
received head replaces the local one and nothing else, and the loss is plain cross-entropy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import coordinator.strategies.lg_fedavg  # noqa: F401  (registers the server half)
from edge_agent.algorithms import EdgeContext
from edge_agent.algorithms.lg_fedavg import LGFedAvgEdge
from edge_agent.trainer import TensorData
from models import Classifier, create_model
from protocol.algorithms.lg_fedavg import LGFedAvgConfig
from protocol.contract.messages import Task
from protocol.contract.payloads import Payload, TensorMap
from protocol.errors import ValidationError

C, D = 3, 4


def make_edge(arch: str = "mlp_s", seed: int = 0) -> LGFedAvgEdge:
    g = torch.Generator().manual_seed(1)
    y = torch.arange(C).repeat(6)
    x = torch.rand(len(y), 1, 8, 8, generator=g)
    torch.manual_seed(seed)

    def build() -> Classifier:
        return create_model(arch, num_classes=C, in_chans=1, feature_dim=D, input_size=8)

    ctx = EdgeContext(
        model=build(),
        train=TensorData(x, y),
        test=TensorData(x[:4], y[:4]),
        num_classes=C,
        device=torch.device("cpu"),
        generator=torch.Generator().manual_seed(seed),
        model_builder=build,
    )
    return LGFedAvgEdge(ctx)


def task(payloads: dict[str, Payload] | None = None) -> Task:
    return Task(
        task_id="t",
        run_id="r",
        round=1,
        phase="train",
        deadline=0.0,
        algorithm="lg_fedavg",
        config=LGFedAvgConfig(batch_size=8).to_dict(),
        payloads=payloads or {},
    )


def test_heads_start_identical_across_architectures_extractors_do_not() -> None:
    a, b = make_edge("mlp_s", seed=0), make_edge("cnn_t1", seed=1)
    a.shared_init()
    b.shared_init()
    for name, t in a.ctx.model.get_classifier().state_dict().items():
        torch.testing.assert_close(t, b.ctx.model.get_classifier().state_dict()[name])
    c = make_edge("mlp_s", seed=2)
    c.shared_init()
    extractor_a = a.ctx.model.extractor_parameters()[0]
    assert not torch.equal(extractor_a, c.ctx.model.extractor_parameters()[0])


def test_only_the_head_is_uploaded_and_the_received_head_replaces_it_alone() -> None:
    a, b = make_edge("mlp_s", seed=0), make_edge("cnn_t1", seed=1)
    up = a.handle(task()).payloads["weights"]
    assert isinstance(up, TensorMap) and sorted(up.tensors) == ["bias", "weight"]
    extractor = [p.detach().clone() for p in b.ctx.model.extractor_parameters()]
    b.receive({"weights": up})
    for name, t in b.ctx.model.get_classifier().state_dict().items():
        np.testing.assert_array_equal(t.numpy(), up.tensors[name])
    for before, after in zip(extractor, b.ctx.model.extractor_parameters(), strict=True):
        assert torch.equal(before, after)


def test_a_head_of_another_feature_dimension_is_refused() -> None:
    wide = TensorMap({"weight": np.zeros((C, D + 1), np.float32), "bias": np.zeros(C, np.float32)})
    with pytest.raises(ValidationError, match="weight"):
        make_edge().receive({"weights": wide})


def test_the_loss_is_plain_cross_entropy() -> None:
    edge = make_edge()
    edge.cfg = LGFedAvgConfig()
    x, y = torch.rand(4, 1, 8, 8), torch.tensor([0, 1, 2, 0])
    feats = edge.ctx.model.forward_features(x)
    logits = edge.ctx.model.forward_head(feats)
    expected = -torch.log_softmax(logits, 1)[torch.arange(4), y].mean()
    assert edge.step_loss(x, y, feats, logits).item() == pytest.approx(expected.item(), rel=1e-6)
