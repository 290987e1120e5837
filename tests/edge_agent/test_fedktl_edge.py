"""FedKTL edge half: L_A + mu * L^M against hand-computed values, the set-up's digest checked,
h' reloaded every round and trained by its own group, unit-norm prototypes (noised under
hyper.dp, byte for byte the plain ones without), the exported cosine head equal to the agent's
scores."""

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
from edge_agent.algorithms.fedktl import (
    UNIT_CLIP,
    FedKTLEdge,
    extractor_output,
    unit_embedding_sums,
)
from edge_agent.class_stats import ClassMeans
from edge_agent.dp import PrivacyBudgetError, noise_multiplier
from models import Classifier, create_model
from models.checkpoint import Checkpoint, save_checkpoint
from models.ktl import arcface_logits
from models.seeding import derived_seed
from protocol.algorithms.fedktl import FedKTLConfig, setup_digest
from protocol.contract.messages import Task
from protocol.contract.payloads import ImageVectorPairs, Payload, TensorMap, pack_payloads
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


# ----- hyper.dp -------------------------------------------------------------------------------
def test_one_sample_moves_its_classs_unit_embedding_sum_by_exactly_one() -> None:
    # Prepare: the trained-or-not model's embeddings, with and without sample i
    edge = make_edge()
    model, data = edge.ctx.model, edge.ctx.train
    keep = torch.arange(len(data)) != 9
    without = dataclasses.replace(data, x=data.x[keep], y=data.y[keep])
    # Execute
    with_it = unit_embedding_sums(model, data, C, clip=UNIT_CLIP)
    less = unit_embedding_sums(model, without, C, clip=UNIT_CLIP)
    # Assert: the sensitivity of the sums is 1 (unit vectors), of the counts 1
    moved = (with_it.sums - less.sums).norm(dim=1)
    assert float(moved[data.y[9]]) == pytest.approx(1.0, rel=1e-5)
    assert float(moved.sum()) == pytest.approx(1.0, rel=1e-5)
    assert (with_it.counts - less.counts).abs().sum().item() == 1


@pytest.mark.parametrize("clip", [0.3, 5.0])
def test_under_dp_the_prototypes_are_noised_unit_vectors_released_at_clip_one(clip: float) -> None:
    # Prepare: a budget of epsilon 2 for one release; a spy on the one release seam
    edge = make_edge()
    released: list[tuple[float, int]] = []
    seam = edge.release

    def spy(stats: list[ClassMeans], contributions: int) -> None:
        released.append((stats[0].clip, contributions))
        seam(stats, contributions)

    edge.release = spy  # type: ignore[method-assign]
    dp = {"dp_epsilon": 2.0, "dp_releases": 1, "dp_clip": clip}
    # Execute: one round releases; the next would exceed the budget
    result = edge.handle(task({"setup": TensorMap(SETUP)}, local_epochs=0, **dp))
    with pytest.raises(PrivacyBudgetError, match="privacy budget spent: 1 releases"):
        edge.handle(task(local_epochs=0, **dp))
    # Assert: released once, each sample once, at the unit bound whatever hyper.dp.clip says
    assert released == [(UNIT_CLIP, 1)]
    z = noise_multiplier(2.0, 1e-5, 1, 2)
    assert edge.ctx.privacy.events == [(z, 2, 1.0)]
    assert result.metrics["dp_epsilon"] == pytest.approx(2.0, rel=1e-3)
    protos = result.payloads["protos"]
    assert protos.class_ids.tolist() == [0, 1, 3]  # the held classes, not the noise's
    np.testing.assert_allclose(np.linalg.norm(protos.vectors, axis=1), 1.0, rtol=1e-5)
    total = sum(edge.ctx.class_counts)  # the public cap: the registered total
    assert all(1 <= n <= total for n in protos.counts.tolist())
    plain = unit_embedding_sums(edge.ctx.model, edge.ctx.train, C)
    exact = F.normalize(plain.sums[[0, 1, 3]], dim=1)
    assert not torch.allclose(torch.as_tensor(protos.vectors), exact, atol=1e-3)


def test_with_dp_off_the_prototypes_are_byte_for_byte_the_plain_ones() -> None:
    # Prepare: two devices of one seed, one round each
    t = task({"setup": TensorMap(SETUP), **pairs(3)}, local_epochs=1)
    edge, again = make_edge(), make_edge()
    # Execute
    result, repeat = edge.handle(t), again.handle(t)
    # Assert: no dp key travels; the prototypes are normalize(sum of normalize(g(x))) computed
    # as the authors' collect_protos does, and a seeded run repeats them exactly
    assert not [k for k in FedKTLConfig().task_config() if k.startswith("dp_")]
    assert not [k for k in result.metrics if k.startswith("dp_")]
    model, data = edge.ctx.model.eval(), edge.ctx.train
    sums = ClassMeans(C, C, data.x.device)
    with torch.no_grad():
        for x, y in data.batches(256, None, shuffle=False):
            sums.add(F.normalize(model.forward_features(x).float(), dim=1), y)
    held = sums.present()
    vectors = F.normalize(sums.sums[held], dim=1).numpy()
    got = result.payloads["protos"]
    assert np.array_equal(got.vectors, vectors) and got.counts.tolist() == [8, 8, 8]
    assert pack_payloads(result.payloads) == pack_payloads(repeat.payloads)
