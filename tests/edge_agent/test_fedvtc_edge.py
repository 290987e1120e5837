"""FedVTC's edge half through the EdgeAlgorithm API (spec §2.3, §2.4, §8-D3/D5/D8)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
import torch
from helpers import edge_context

from edge_agent.algorithms.fedvtc import FedVTCEdge
from edge_agent.trainer import ParamGroup, TensorData, train_epochs
from models import create_model
from protocol.algorithms.fedvtc import FedVTCConfig
from protocol.contract.messages import Task
from protocol.contract.payloads import Payload, PrototypeSet
from protocol.errors import ConfigError

C, P = 4, 64  # classes; latent p = 64 -> the toy 16x2x2 VTC at 8x8
HELD = (0, 2)  # the client's classes; 1 and 3 are absent


def make_edge(seed: int = 0, model: str = "cnn_bn3") -> FedVTCEdge:
    """A client holding classes 0 and 2 of 4, with a BN model (so 'model unchanged' covers
    BatchNorm buffers too) and a 20-image global test set."""
    g = torch.Generator().manual_seed(123)  # the same data on every call
    y = torch.tensor(HELD).repeat_interleave(12)
    x = torch.rand(len(y), 1, 8, 8, generator=g) * 0.5 + 0.5 * (y == 2).float().view(-1, 1, 1, 1)
    yt = torch.arange(C).repeat(5)
    test = TensorData(torch.rand(len(yt), 1, 8, 8, generator=g), yt)
    torch.manual_seed(seed)  # model and (per-client) generator init, as build_agent does
    net = create_model(model, num_classes=C, in_chans=1, feature_dim=P, input_size=8)
    ctx = edge_context(net, x, y, num_classes=C, test_size=4, seed=seed, global_test=test)
    return FedVTCEdge(ctx)


def task(phase: str, payloads: dict[str, Payload] | None = None, **cfg: object) -> Task:
    config = FedVTCConfig(
        local_epochs=1, batch_size=8, synthetic_per_class=6, finetune_epochs=1
    ).replace(**cfg)
    return Task(
        task_id=f"t-{phase}",
        run_id="r",
        round=1,
        phase=phase,
        deadline=0.0,
        algorithm="fedvtc",
        config=config.to_dict(),
        payloads=payloads or {},
    )


def protos(classes: list[int], value: float = 0.5, sd: float = 1.0) -> PrototypeSet:
    return PrototypeSet(
        np.array(classes),
        np.full((len(classes), P), value, np.float32),
        np.ones(len(classes), np.int32),
        sd=np.full(P, sd, np.float32),
    )


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_train_round_replies_held_prototypes_with_sd_and_stays_finite() -> None:
    edge = make_edge()
    gen0 = snapshot(edge.generator)
    result = edge.handle(task("train", {"protos": protos([0], sd=0.5)}))
    reply = result.payloads["protos"]
    assert isinstance(reply, PrototypeSet)
    assert reply.class_ids.tolist() == list(HELD)  # exactly the held classes, never 1 or 3
    assert reply.vectors.shape == (2, P) and np.isfinite(reply.vectors).all()
    assert reply.sd is not None and reply.sd.shape == (P,)
    assert np.isfinite(reply.sd).all() and (reply.sd > 0).all()
    assert abs(result.metrics["sigma_mean"] - 0.5) < 0.1  # sigma_k started at the global 0.5
    assert all(torch.isfinite(v).all() for v in edge.generator.state_dict().values())
    assert not same(gen0, snapshot(edge.generator)) and edge.generator_trained


def test_step_a_moves_only_the_model_and_step_b_only_the_generator() -> None:
    # Prepare: one batch through the one loop, with a spy at the start of step B; joint
    # clipping (one model group) and psi in eval mode in step A: psi wholly unchanged
    edge = make_edge()
    old = {"grad_clip_mode": "joint", "generator_mode_step_a": "eval"}
    edge.handle(task("train", {"protos": protos([0, 2])}, local_epochs=0, **old))
    assert edge.valid.tolist() == [True, False, True, False]
    model = edge.ctx.model
    batch = TensorData(edge.ctx.train.x[:8], edge.ctx.train.y[:8])
    m0, g0, rho0 = snapshot(model), snapshot(edge.generator), edge.rho.detach().clone()
    model_group, step_b = edge.param_groups()
    assert step_b.loss is not None
    seen: dict[str, object] = {}

    def spy(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        seen.update(
            model=snapshot(model),
            generator=snapshot(edge.generator),
            rho=edge.rho.detach().clone(),
            modes=(model.training, edge.generator.training),
            model_frozen=not any(p.requires_grad for p in model.parameters()),
            generator_free=all(p.requires_grad for p in step_b.tensors()),
        )
        return step_b.loss(x, y)  # type: ignore[misc]

    groups = [model_group, dataclasses.replace(step_b, loss=spy)]
    # Execute
    train_epochs(model, batch, edge.config, edge, groups=groups, epochs=1)
    # Assert: step A moved the model only (generator and sigma frozen) ...
    assert not same(m0, seen["model"])  # type: ignore[arg-type]
    assert same(g0, seen["generator"])  # type: ignore[arg-type]
    assert torch.equal(rho0, seen["rho"])  # type: ignore[arg-type]
    # ... step B ran with the model frozen in eval mode and the generator training ...
    assert seen["modes"] == (False, True) and seen["model_frozen"] and seen["generator_free"]
    # ... and moved the generator and sigma, not the model (BN buffers included)
    assert same(seen["model"], snapshot(model))  # type: ignore[arg-type]
    assert not same(g0, snapshot(edge.generator)) and not torch.equal(rho0, edge.rho.detach())
    # the loop leaves every group training with its gradients on
    assert model.training and edge.generator.training
    assert all(p.requires_grad for g in groups for p in g.tensors())


def test_step_a_runs_psi_on_batch_statistics_with_its_weights_frozen() -> None:
    # Prepare: the default settings; a forward hook on psi and a spy at the start of step B
    edge = make_edge()
    edge.handle(task("train", {"protos": protos([0, 2])}, local_epochs=0))
    model, psi = edge.ctx.model, edge.generator
    groups = edge.param_groups()
    assert [g.name for g in groups] == ["extractor", "head", "generator", "sigma"]
    calls: list[tuple[bool, bool]] = []
    psi.register_forward_hook(
        lambda m, i, o: calls.append((m.training, any(p.requires_grad for p in m.parameters())))
    )
    params0 = {k: v.detach().clone() for k, v in psi.named_parameters()}
    buffers0 = {k: v.clone() for k, v in psi.named_buffers() if "running" in k}
    rho0 = edge.rho.detach().clone()
    seen: dict[str, dict[str, torch.Tensor]] = {}

    def spy(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        seen["params"] = {k: v.detach().clone() for k, v in psi.named_parameters()}
        seen["buffers"] = {k: v.clone() for k, v in psi.named_buffers() if "running" in k}
        seen["rho"] = {"rho": edge.rho.detach().clone()}
        return edge._generator_loss(x, y)

    groups = [*groups[:2], *(dataclasses.replace(g, loss=spy) for g in groups[2:])]
    batch = TensorData(edge.ctx.train.x[:8], edge.ctx.train.y[:8])
    # Execute
    train_epochs(model, batch, edge.config, edge, groups=groups, epochs=1)
    # Assert: step A decoded with psi in train mode and no gradient for psi; its BatchNorm
    # running statistics moved, its weights and sigma did not; step B then trained psi
    assert calls[0] == (True, False) and calls[1] == (True, True)
    assert same(params0, seen["params"]) and torch.equal(rho0, seen["rho"]["rho"])
    assert all(not torch.equal(buffers0[k], seen["buffers"][k]) for k in buffers0)
    assert buffers0 and not same(seen["params"], dict(psi.named_parameters()))


def _grads_and_update(
    edge: FedVTCEdge,
    groups: list[ParamGroup],
    cfg: FedVTCConfig,
    tensors: list[torch.Tensor],
    step: str,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """One batch through the loop; the gradients of ``tensors`` at the start of ``step``
    ("A" or "B") from the same noise draw, the tensors before that step and after the batch."""
    model = edge.ctx.model
    x, y = edge.ctx.train.x[:8], edge.ctx.train.y[:8]
    seen: dict[str, list[torch.Tensor]] = {}

    def measure(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]) -> None:
        state = edge.noise.get_state()
        order = torch.randperm(8, generator=torch.Generator().manual_seed(7))
        loss = loss_fn(x[order], y[order])
        assert loss is not None
        seen["grads"] = list(torch.autograd.grad(loss, tensors, allow_unused=False))
        seen["before"] = [t.detach().clone() for t in tensors]
        edge.noise.set_state(state)

    def step_a(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        feats = model.forward_features(xb)
        return edge.step_loss(xb, yb, feats, model.forward_head(feats))

    if step == "A":
        model.train()
        edge.generator.train()
        with torch.enable_grad():
            for t in tensors:
                t.requires_grad_(True)
            measure(step_a)
    else:

        def spy(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor | None:
            measure(edge._generator_loss)
            return edge._generator_loss(xb, yb)

        groups = [*groups[:2], *(dataclasses.replace(g, loss=spy) for g in groups[2:])]
    batch = TensorData(x, y)
    gen = torch.Generator().manual_seed(7)
    train_epochs(model, batch, cfg, edge, groups=groups, epochs=1, generator=gen)
    return seen["grads"], seen["before"], [t.detach().clone() for t in tensors]


def _expected(before: torch.Tensor, grad: torch.Tensor, lr: float, factor: float) -> torch.Tensor:
    return before - lr * factor * grad


def _check_clipped_apart(parts: dict[str, list[int]], step: str) -> None:
    """Run once unclipped to learn the two parts' gradient norms, then again (same start, same
    noise) with a clip between them: each part's update is its own gradient scaled by its own
    factor min(1, clip / its norm); a joint clip would scale both by clip / joint norm."""

    def run(clip: float) -> tuple[list[torch.Tensor], ...]:
        edge = make_edge()
        edge.handle(task("train", {"protos": protos([0, 2])}, local_epochs=0))
        groups = edge.param_groups()
        if step == "B":  # step A must not move the model: step B's gradients then do not
            groups = [dataclasses.replace(g, lr=0.0) for g in groups[:2]] + [
                dataclasses.replace(g, grad_clip=clip) for g in groups[2:]
            ]
        tensors = [t for g in (groups[:2] if step == "A" else groups[2:]) for t in g.tensors()]
        cfg = edge.config.replace(grad_clip=clip if step == "A" else 0.0)
        return _grads_and_update(edge, groups, cfg, tensors, step)

    grads, *_ = run(0.0)
    norms = {
        k: float(torch.stack([grads[i].norm() for i in idx]).norm()) for k, idx in parts.items()
    }
    low, high = sorted(norms.values())
    assert high > 2 * low  # the premise: one part's gradient dwarfs the other's
    clip = (low * high) ** 0.5
    grads, before, after = run(clip)
    lr = 0.01  # FedVTCConfig's lr for every group here
    for name, idx in parts.items():
        factor = min(1.0, clip / norms[name])
        for i in idx:
            assert torch.allclose(
                after[i], _expected(before[i], grads[i], lr, factor), atol=1e-6
            ), name


def test_split_clipping_clips_the_head_apart_from_the_extractor() -> None:
    model = make_edge().ctx.model
    n_head = len(list(model.get_classifier().parameters()))
    n_ext = len(list(model.parameters())) - n_head
    _check_clipped_apart(
        {"extractor": list(range(n_ext)), "head": list(range(n_ext, n_ext + n_head))}, "A"
    )


def test_split_clipping_clips_psi_apart_from_sigma() -> None:
    edge = make_edge()
    n_psi = len(list(edge.generator.parameters()))
    _check_clipped_apart({"psi": list(range(n_psi)), "sigma": [n_psi]}, "B")


def test_classes_without_a_global_prototype_add_no_prototype_terms() -> None:
    edge = make_edge()
    edge.handle(task("train", {"protos": protos([0])}, local_epochs=0))
    x = edge.ctx.train.x[edge.ctx.train.y == 2][:6]
    y = torch.full((6,), 2)
    edge.generator.eval()

    def loss() -> float:
        edge.noise.manual_seed(7)  # the same latent noise for every evaluation
        with torch.no_grad():
            return float(edge._tc(x, y, edge.ctx.model.forward_features(x)))

    base = loss()
    edge.table[2] = 100.0  # a wild prototype for class 2, still marked invalid
    assert loss() == pytest.approx(base, rel=1e-6)
    edge.valid[2] = True  # once valid, its KL and DM terms count
    assert loss() > base + 1.0


def test_synthesize_gives_s_samples_for_each_valid_class_only() -> None:
    edge = make_edge()
    edge.handle(task("train", {"protos": protos([1, 3])}, local_epochs=0))
    data = edge.synthesize(5)
    assert torch.bincount(data.y, minlength=C).tolist() == [0, 5, 0, 5]
    assert data.x.shape == (10, 1, 8, 8)
    assert float(data.x.min()) > 0.0 and float(data.x.max()) < 1.0  # Sigmoid output
    noise = edge.synthesize(5, source="noise")
    assert noise.y.tolist() == data.y.tolist() and not torch.equal(noise.x, data.x)


def test_shared_init_gives_every_client_the_same_generator() -> None:
    a, b = make_edge(seed=1), make_edge(seed=2)
    assert not same(snapshot(a.generator), snapshot(b.generator))  # per-client init
    for edge in (a, b):  # no steps: the generator is exactly its initial state
        edge.handle(task("train", {"protos": protos([0])}, local_epochs=0))
    assert same(snapshot(a.generator), snapshot(b.generator))
    c, d = make_edge(seed=1), make_edge(seed=2)
    for edge in (c, d):
        edge.handle(task("train", local_epochs=0, shared_generator_init=False))
    assert not same(snapshot(c.generator), snapshot(d.generator))


def test_diagnostics_report_controls_without_changing_the_finetuned_model() -> None:
    runs = []
    for diagnostics in (False, True):
        edge = make_edge(model="cnn_t1")
        edge.handle(task("train", {"protos": protos([0, 2])}))
        final = {"protos": protos([0, 1, 2, 3], sd=0.3), "generator": edge.generator_payload()}
        result = edge.handle(task("final", final, diagnostics=diagnostics))
        runs.append((snapshot(edge.ctx.model), result.metrics))
    (plain, m_plain), (diag, m_diag) = runs
    assert same(plain, diag)  # the controls ran on copies and restored the random stream
    assert m_plain["synthetic_samples"] == m_diag["synthetic_samples"] == 4 * 6
    assert m_plain["acc_global_before_ft"] == m_diag["acc_global_before_ft"]
    for key in (
        "acc_global_noise_control",
        "probe_acc_global",
        "probe_acc_global_own_gen",
        "gen_class_contrast",
    ):
        assert key in m_diag and key not in m_plain
        assert np.isfinite(m_diag[key])
    assert 0.0 <= m_diag["probe_acc_global"] <= 1.0


def test_averaged_generator_carries_mean_weights_and_bn_buffers_into_the_client() -> None:
    # Prepare: two clients train their (shared-init) generators apart, BN buffers included
    from coordinator.aggregation import weighted_mean

    a, b = make_edge(seed=1), make_edge(seed=2)
    a.handle(task("train", {"protos": protos([0, 2], value=0.2)}))
    b.handle(task("train", {"protos": protos([0, 2], value=0.9)}, local_epochs=2))
    ga, gb = a.generator_payload(), b.generator_payload()
    bn_keys = [k for k in ga.tensors if k.endswith(("running_mean", "running_var"))]
    assert len(bn_keys) == 8  # 4 blocks x (mean, var)
    assert any(not np.allclose(ga.tensors[k], gb.tensors[k]) for k in bn_keys)
    # Execute: the server's average, received by a third client in the final phase
    avg = weighted_mean([ga, gb])
    c = make_edge(seed=3)
    c.handle(task("train", {"protos": protos([0, 2])}, local_epochs=0))
    c.receive({"generator": avg})
    # Assert: every float tensor is the element-wise mean, the batch counter the max
    got = c.generator.state_dict()
    assert set(got) == set(ga.tensors)
    for k, v in got.items():
        if k.endswith("num_batches_tracked"):
            assert int(v) == max(int(ga.tensors[k]), int(gb.tensors[k])) > 0
        else:
            np.testing.assert_allclose(
                v.numpy(), (ga.tensors[k] + gb.tensors[k]) / 2, rtol=1e-6, atol=1e-7
            )
    # generation uses those averaged running statistics (eval mode): batch-independent
    c.generator.eval()
    v = c.table[[0, 2]]
    with torch.no_grad():
        assert torch.allclose(c.generator(v)[:1], c.generator(v[:1]), atol=1e-6)


def test_model_tc_weight_scales_l_tc_in_step_a_only() -> None:
    # Prepare: the same batch and latent noise under the paper's weight (1) and a smaller one
    edge = make_edge()
    edge.handle(task("train", {"protos": protos([0, 2])}, local_epochs=0))
    model, x, y = edge.ctx.model, edge.ctx.train.x[:8], edge.ctx.train.y[:8]
    model.eval()

    def step_a(weight: float) -> tuple[float, float]:
        edge.cfg = edge.config.replace(model_tc_weight=weight)
        edge.noise.manual_seed(5)
        with torch.no_grad():
            z = model.forward_features(x)
            loss = float(edge.step_loss(x, y, z, model.forward_head(z)))
            ce = float(torch.nn.functional.cross_entropy(model.forward_head(z), y))
        return loss, ce

    # Execute
    (paper, ce), (scaled, _) = step_a(1.0), step_a(0.01)
    # Assert: CE + w * L_tc, with L_tc itself unchanged
    tc = paper - ce
    assert tc > 10 * ce  # the paper's sums dwarf CE at any size (the reason for the knob)
    assert scaled == pytest.approx(ce + 0.01 * tc, rel=1e-4)
    # step B's generator loss does not depend on the weight
    edge.noise.manual_seed(6)
    with torch.no_grad():
        z = model.forward_features(x)
        b1 = float(edge._tc(x, y, z))
    edge.cfg = edge.config.replace(model_tc_weight=1.0)
    edge.noise.manual_seed(6)
    with torch.no_grad():
        assert float(edge._tc(x, y, z)) == b1


def test_a_feature_size_the_generator_cannot_reshape_is_refused_naming_the_flag() -> None:
    g = torch.Generator().manual_seed(0)
    y = torch.tensor(HELD).repeat_interleave(4)
    x = torch.rand(len(y), 1, 28, 28, generator=g)
    net = create_model("cnn_bn3", num_classes=C, in_chans=1, feature_dim=64, input_size=28)
    ctx = edge_context(net, x, y, num_classes=C, test_size=2, seed=0)
    with pytest.raises(ConfigError, match=r"multiple of 49: give the fleet --feature-dim 98 "):
        FedVTCEdge(ctx)
