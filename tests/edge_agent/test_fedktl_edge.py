"""FedKTL edge half: L_A + mu * L^M against hand-computed values, the set-up's digest checked,
h' reloaded every round and trained by its own group, unit-norm prototypes, the exported
cosine head equal to the agent's scores."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import edge_context

import coordinator.strategies.fedktl.strategy
import edge_agent.algorithms.fedktl  # noqa: F401  (registers both halves)
from coordinator.strategies.fedktl.server import make_setup
from edge_agent.algorithms.fedktl import FedKTLEdge, extractor_output
from edge_agent.seeding import derived_seed
from models import Classifier, create_model
from models.checkpoint import Checkpoint, save_checkpoint
from models.ktl import arcface_logits
from protocol.algorithms.fedktl import FedKTLConfig, setup_digest
from protocol.contract.messages import Task
from protocol.contract.payloads import ImageVectorPairs, Payload, TensorMap
from protocol.errors import ConfigError, ValidationError

C, KP, H = 4, 6, 5  # classes (= K), K', latent size

_ = coordinator.strategies.fedktl.strategy


def make_edge(seed: int = 0) -> FedKTLEdge:
    g = torch.Generator().manual_seed(1)
    y = torch.tensor([0, 1, 3]).repeat_interleave(8)  # the client lacks class 2
    x = torch.rand(len(y), 1, 8, 8, generator=g)
    torch.manual_seed(seed)

    def build() -> Classifier:
        return create_model("cnn_t1", num_classes=C, in_chans=1, feature_dim=C, input_size=8)

    ctx = edge_context(build(), x, y, num_classes=C, test_size=6, seed=seed, builder=build)
    return FedKTLEdge(ctx)


SETUP = make_setup(C, C, KP, H, seed=7)
DIGEST = setup_digest(SETUP)


IDS = np.arange(2)


def pairs(n: int = 3) -> dict[str, Payload]:
    g = np.random.default_rng(0)
    images = g.integers(0, 256, (n, 1, 8, 8), dtype=np.uint8)
    latents = g.standard_normal((n, H)).astype(np.float32)
    return {"pairs": ImageVectorPairs(images, latents, class_ids=np.arange(n), round=1)}


def task(payloads: dict[str, Payload] | None = None, **cfg: object) -> Task:
    config = FedKTLConfig(feature_dim=KP, latent_dim=H, setup_sha256=DIGEST, mu=2.0)
    return Task(
        task_id="t",
        run_id="r",
        round=2,
        phase="train",
        deadline=0.0,
        algorithm="fedktl",
        config=config.replace(**cfg).to_dict(),
        payloads=payloads or {},
    )


def with_setup(edge: FedKTLEdge, payloads: dict[str, Payload] | None = None) -> FedKTLEdge:
    t = task({"setup": TensorMap(SETUP), **(payloads or {})})
    edge.cfg = edge.parse_config(t)
    edge.receive(t.payloads)
    return edge


def test_step_loss_is_arcface_plus_mu_times_the_regression_on_the_extractor_output() -> None:
    # Prepare
    edge = with_setup(make_edge(), pairs(3))
    model, x, y = edge.ctx.model, edge.ctx.train.x[:5], edge.ctx.train.y[:5]
    features = model.forward_features(x)
    v_t = F.normalize(torch.as_tensor(SETUP["etf"]).T, dim=1)
    arc = F.cross_entropy(arcface_logits(F.normalize(features, dim=1) @ v_t.T, y), y)
    # the first L^M batch: the seeded permutation of the 3 pairs (batch 10 takes them all), on
    # a stream of its own: the private data's batch order stays `local`'s
    base = edge.ctx.generator.initial_seed()
    pair_seed = derived_seed(base, "fedktl-pairs")
    order = torch.randperm(3, generator=torch.Generator().manual_seed(pair_seed))
    batch_stream = edge.ctx.generator.get_state()
    assert edge.images is not None and edge.latents is not None
    f = extractor_output(model, edge.images[order], KP)
    w, b = torch.as_tensor(SETUP["proj.weight"]), torch.as_tensor(SETUP["proj.bias"])
    mse = ((f @ w.T + b - edge.latents[order]) ** 2).mean()

    # Execute
    loss = edge.step_loss(x, y, features, model.forward_head(features))

    # Assert
    assert loss.item() == pytest.approx(arc.item() + 2.0 * mse.item(), rel=1e-5)
    assert f.shape == (3, KP)
    assert torch.equal(edge.ctx.generator.get_state(), batch_stream)


def test_regression_trains_the_extractor_and_h_prime_but_not_h() -> None:
    edge = with_setup(make_edge(), pairs(3))
    edge.cfg = edge.config.replace(arc_scale=1e-6, arc_margin=0.0)  # L_A ~ constant
    model, x, y = edge.ctx.model, edge.ctx.train.x[:5], edge.ctx.train.y[:5]
    features = model.forward_features(x).detach()  # only L^M reaches the model
    edge.step_loss(x, y, features, model.forward_head(features)).backward()
    assert edge.proj is not None and edge.proj.weight.grad is not None
    assert model.proj.weight.grad is None  # h: not part of L^M
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.trunk.parameters())


def test_round_one_without_pairs_is_arcface_only() -> None:
    edge = with_setup(make_edge())
    model, x, y = edge.ctx.model, edge.ctx.train.x[:5], edge.ctx.train.y[:5]
    features = model.forward_features(x)
    v_t = edge.etf_t
    assert v_t is not None and edge.images is None
    arc = F.cross_entropy(arcface_logits(F.normalize(features, dim=1) @ v_t.T, y), y)
    loss = edge.step_loss(x, y, features, model.forward_head(features))
    assert loss.item() == pytest.approx(arc.item(), rel=1e-6)


def test_h_prime_trains_in_its_own_group_and_is_reloaded_every_round() -> None:
    # Prepare
    edge = make_edge()
    first = task({"setup": TensorMap(SETUP), **pairs(3)}, local_epochs=1)

    # Execute: a round trains h'; the next task (no set-up: the agent holds it) reloads it
    result = edge.handle(first)
    assert edge.proj is not None
    trained = edge.proj.weight.detach().clone()
    groups = edge.param_groups()
    edge.handle(task(pairs(3), local_epochs=0))

    # Assert
    assert [g.name for g in groups] == ["model", "proj"]
    assert (groups[1].grad_clip, groups[1].optimizer, groups[1].momentum) == (100.0, "sgd", 0.0)
    assert not torch.allclose(trained, torch.as_tensor(SETUP["proj.weight"]))
    torch.testing.assert_close(edge.proj.weight.detach(), torch.as_tensor(SETUP["proj.weight"]))
    protos = result.payloads["protos"]
    assert protos.class_ids.tolist() == [0, 1, 3]
    np.testing.assert_allclose(np.linalg.norm(protos.vectors, axis=1), 1.0, rtol=1e-5)


def test_a_participation_reports_how_old_its_pairs_are_and_refuses_pairs_not_from_the_past() -> (
    None
):
    # Prepare: pairs made in round 1, the task is round 2; then the same pairs in a round-1 task
    edge = make_edge()
    current = task({"setup": TensorMap(SETUP), **pairs(3)}, local_epochs=0)
    replayed = dataclasses.replace(task(pairs(3), local_epochs=0), round=1)

    # Execute
    result = edge.handle(current)

    # Assert
    assert result.metrics["ktl_pairs_age"] == 1.0
    refusal = r"payloads\.pairs\.round: expected < the task's round 1"
    with pytest.raises(ValidationError, match=refusal):
        edge.handle(replayed)


def test_set_up_digest_mismatch_and_a_missing_set_up_are_errors() -> None:
    edge = make_edge()
    bad = task({"setup": TensorMap(SETUP)}, setup_sha256="0" * 64)
    with pytest.raises(ValidationError, match=r"payloads\.setup"):
        edge.handle(bad)
    with pytest.raises(ConfigError, match="holds no set-up"):
        make_edge().handle(task())
    # an agent holding one set-up refuses a config naming another
    edge.handle(task({"setup": TensorMap(SETUP)}, local_epochs=0))
    with pytest.raises(ValidationError, match="setup_sha256"):
        edge.handle(task(setup_sha256="f" * 64, local_epochs=0))


def test_model_with_the_wrong_feature_size_gets_a_precise_error() -> None:
    edge = make_edge()
    edge.ctx.model = create_model("cnn_t1", num_classes=C, in_chans=1, feature_dim=16, input_size=8)
    with pytest.raises(ConfigError, match="feature_dim = 4"):
        edge.handle(task({"setup": TensorMap(SETUP)}))


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (ImageVectorPairs(np.zeros((2, 1, 12, 12), np.uint8), np.zeros((2, H)), IDS), "images"),
        (ImageVectorPairs(np.zeros((2, 1, 8, 8), np.uint8), np.zeros((2, 3)), IDS), "vectors"),
        (ImageVectorPairs(np.zeros((2, 1, 8, 8), np.uint8), np.zeros((2, H))), "class_ids"),
        (ImageVectorPairs(np.zeros((2, 1, 8, 8), np.uint8), np.zeros((2, H)), [1, C]), "class_ids"),
    ],
)
def test_pairs_that_do_not_fit_the_agent_are_refused(payload: ImageVectorPairs, field: str) -> None:
    with pytest.raises(ValidationError, match=f"payloads.pairs.{field}"):
        make_edge().handle(task({"setup": TensorMap(SETUP), "pairs": payload}))


def test_set_up_survives_a_restart_and_the_export_head_is_the_etf(tmp_path: Path) -> None:
    # Prepare: one round, then a checkpoint as the agent writes it
    edge = make_edge()
    edge.handle(task({"setup": TensorMap(SETUP)}))
    ckpt = Checkpoint.from_model(edge.ctx.model, edge.head_spec(), extra=edge.extra_state())
    save_checkpoint(tmp_path / "c.json", ckpt)

    # Execute: a fresh agent restores it and handles a task without set-up
    again = make_edge(seed=1)
    again.ctx.model.load_state_dict(ckpt.state_dict)
    again.load_extra_state(dict(ckpt.extra))
    again.handle(task(local_epochs=0))

    # Assert: the head is the cosine over the ETF rows, the same scores as the agent's
    head = again.head_spec()
    assert head.type == "cosine" and head.prototypes is not None
    torch.testing.assert_close(head.prototypes, F.normalize(torch.as_tensor(SETUP["etf"]).T, dim=1))
    from export.heads import with_head

    x = edge.ctx.test.x
    scores, label = with_head(again.ctx.model, head)(x)
    torch.testing.assert_close(scores, again.scores(x))
    assert torch.equal(label, again.scores(x).argmax(1))
