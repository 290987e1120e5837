"""FedProto edge half: the agents' common start and the accuracy in HtFLlib's
evaluation order."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from helpers import edge_algorithm, edge_context

import coordinator.strategies.fedproto  # noqa: F401  (registers the server half)
from edge_agent.algorithms.fedproto import FedProtoEdge
from edge_agent.class_stats import class_prototypes
from edge_agent.dp import clip_rows
from edge_agent.trainer import evaluate
from models import create_model
from protocol.algorithms.fedproto import FedProtoConfig
from protocol.contract.messages import Task
from protocol.contract.payloads import PrototypeSet

C, D = 3, 4


def make_edge(seed: int = 0, arch: str = "mlp_s") -> FedProtoEdge:
    torch.manual_seed(0)
    y = torch.tensor([0, 1, 2]).repeat(6)
    x = torch.rand(len(y), 1, 8, 8) + y.view(-1, 1, 1, 1) * 0.3
    build = functools.partial(
        create_model, arch, num_classes=C, in_chans=1, feature_dim=D, input_size=8
    )
    torch.manual_seed(seed)  # each agent its own initialisation, as the factory gives
    net = build()
    ctx = edge_context(net, x, y, num_classes=C, test_size=9, builder=build)
    return edge_algorithm("fedproto", FedProtoEdge, ctx)


def task(
    payloads: dict,
    predict: str = "prototype",
    shared_init: str = "architecture",
    proto_source: str = "model",
) -> Task:
    cfg = FedProtoConfig(
        local_epochs=1,
        batch_size=4,
        lr=0.5,
        predict=predict,  # type: ignore[arg-type]
        shared_init=shared_init,  # type: ignore[arg-type]
        proto_source=proto_source,  # type: ignore[arg-type]
    )
    return Task(
        task_id="t",
        run_id="r",
        round=2,
        phase="train",
        deadline=0.0,
        algorithm="fedproto",
        config=cfg.to_dict(),
        payloads=payloads,
    )


def test_received_accuracy_is_the_old_model_with_the_fresh_prototypes() -> None:
    edge = make_edge()
    ref = make_edge()  # the same model, evaluated by hand with the same prototypes
    ref.cfg = FedProtoConfig(predict="prototype")
    ref.shared_init()
    protos = class_prototypes(ref.ctx.model, ref.ctx.train, C)
    ref.receive({"protos": protos})
    want = evaluate(ref.ctx.model, ref.ctx.test, ref.scores).accuracy
    result = edge.handle(task({"protos": protos}))
    assert result.metrics["acc_local_received"] == want
    after = evaluate(edge.ctx.model, edge.ctx.test, edge.scores).accuracy
    assert not torch.equal(edge.ctx.model.head.weight, ref.ctx.model.head.weight)  # it trained
    assert 0.0 <= after <= 1.0


def test_no_received_accuracy_without_prototypes_or_with_head_prediction() -> None:
    edge = make_edge()
    assert "acc_local_received" not in edge.handle(task({})).metrics  # round 1: none yet
    protos = PrototypeSet(np.arange(C), np.ones((C, D), np.float32), np.full(C, 6))
    assert "acc_local_received" not in edge.handle(task({"protos": protos}, "head")).metrics


def _state(edge: FedProtoEdge) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in edge.ctx.model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefix: str = "") -> bool:
    return all(torch.equal(a[k], b[k]) for k in a if k.startswith(prefix))


@pytest.mark.parametrize("mode", ["architecture", "head"])
def test_agents_of_one_architecture_start_alike(mode: str) -> None:
    a, b = make_edge(seed=1), make_edge(seed=2)
    assert not _same(_state(a), _state(b))  # the factory's per-agent start differs
    for edge in (a, b):
        edge.cfg = FedProtoConfig(shared_init=mode)  # type: ignore[arg-type]
        edge.shared_init()
    assert _same(_state(a), _state(b))


def test_head_mode_gives_every_architecture_one_head() -> None:
    mlp, cnn = make_edge(seed=1), make_edge(seed=2, arch="cnn_t1")
    for mode, alike in (("architecture", False), ("head", True)):
        for edge in (mlp, cnn):
            edge.cfg = FedProtoConfig(shared_init=mode)  # type: ignore[arg-type]
            edge.shared_init()
        same = _same(_state(mlp), _state(cnn), "head.")
        assert same is alike, mode


def test_none_keeps_each_agents_own_start() -> None:
    a, b = make_edge(seed=1), make_edge(seed=2)
    before = _state(a)
    a.handle(task({}, shared_init="none"))
    b.handle(task({}, shared_init="none"))
    assert not _same(_state(a), _state(b))
    assert not _same(before, _state(a))  # it trained, from its own start


class _Recorder:
    """Keeps every (features, labels) pair the training steps hand to ``after_step``."""

    def __init__(self, edge: FedProtoEdge) -> None:
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        original = edge.after_step

        def record(x: torch.Tensor, y: torch.Tensor, f: torch.Tensor, lo: torch.Tensor) -> None:
            self.seen.append((f.clone(), y.clone()))
            original(x, y, f, lo)

        edge.after_step = record  # type: ignore[method-assign]


@pytest.mark.parametrize("source", ["model", "training"])
def test_uploaded_prototypes_come_from_the_trained_model_or_from_training(source: str) -> None:
    # Prepare: a round with prototypes to pull towards, so the model moves within the epoch
    edge = make_edge()
    steps = _Recorder(edge)
    protos = PrototypeSet(np.arange(C), np.ones((C, D), np.float32), np.full(C, 6))
    # Execute
    up = edge.handle(task({"protos": protos}, proto_source=source)).payloads["protos"]
    # Assert: "training" averages the features the steps computed (HtFLlib's clients); "model"
    # recomputes them with the trained model in eval mode
    assert isinstance(up, PrototypeSet)
    feats = torch.cat([f for f, _ in steps.seen])
    labels = torch.cat([y for _, y in steps.seen])
    during = torch.stack([feats[labels == c].mean(0) for c in range(C)]).numpy()
    after = class_prototypes(edge.ctx.model, edge.ctx.train, C).vectors
    assert up.class_ids.tolist() == [0, 1, 2]
    assert up.counts.tolist() == torch.bincount(labels, minlength=C).tolist()
    want, other = (during, after) if source == "training" else (after, during)
    np.testing.assert_allclose(up.vectors, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(up.vectors, other, atol=1e-3)


def test_cosine_prediction_scores_and_exports_the_most_aligned_prototype() -> None:
    edge = make_edge()
    edge.cfg = FedProtoConfig(predict="cosine")
    protos = class_prototypes(edge.ctx.model, edge.ctx.train, C)
    edge.receive({"protos": protos})
    head = edge.head_spec()
    assert head.type == "cosine" and head.prototypes is not None
    x = edge.ctx.test.x
    features = edge.ctx.model.forward_features(x)
    want = (
        torch.nn.functional.normalize(features, dim=1)
        @ torch.nn.functional.normalize(head.prototypes, dim=1).T
    )
    assert torch.allclose(edge.scores(x), want, atol=1e-5)


@pytest.mark.parametrize("mode", ["raw", "clipped"])
def test_under_dp_the_clipped_regulariser_compares_features_clipped_as_released(
    mode: str,
) -> None:
    edge = make_edge()
    edge.cfg = FedProtoConfig(
        proto_weight=1.0,
        dp_epsilon=8.0,
        dp_delta=1e-5,
        dp_clip=0.01,  # below every feature's norm: clipping changes each one
        dp_releases=10,
        dp_regulariser=mode,  # type: ignore[arg-type]
    )
    protos = PrototypeSet(np.arange(C), np.full((C, D), 0.002, np.float32), np.full(C, 6))
    edge.receive({"protos": protos})
    edge.local_train(edge.ctx.train, 1)
    x, y = edge.ctx.train.x, edge.ctx.train.y
    features = edge.ctx.model.forward_features(x)
    logits = edge.ctx.model.forward_head(features)
    compared = clip_rows(features, 0.01) if mode == "clipped" else features
    want = torch.nn.functional.cross_entropy(logits, y) + torch.nn.functional.mse_loss(
        compared, edge.table[y]
    )
    assert torch.allclose(edge.step_loss(x, y, features, logits), want)
