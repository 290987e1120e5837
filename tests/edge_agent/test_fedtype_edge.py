"""FedType edge half: only the proxy is uploaded, the proxy starts identical fleet-wide,
calibration once per epoch from frozen snapshots on the held-out split, the §10 arms as config
values, FedProx, restart, and export of the private model and the proxy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import edge_context

import coordinator.strategies.fedtype
import edge_agent.algorithms.fedtype as fedtype_edge  # registers
from edge_agent.algorithms.fedtype import FedTypeEdge
from models import Classifier, create_model
from models.checkpoint import save_checkpoint
from protocol.algorithms.fedtype import FedTypeConfig
from protocol.contract.messages import Task
from protocol.contract.payloads import Payload, TensorMap

assert coordinator.strategies.fedtype  # both halves registered (test_strategies checks pairs)
C = 4


def make_edge(model: str = "mlp_s", seed: int = 0, n: int = 160) -> FedTypeEdge:
    g = torch.Generator().manual_seed(100 + seed)
    y = torch.arange(n) % C
    x = (torch.rand(n, 1, 8, 8, generator=g) * 0.5 + y.view(-1, 1, 1, 1) / (2 * C)).clamp(0, 1)

    def build() -> Classifier:
        return create_model(model, num_classes=C, in_chans=1, feature_dim=16, input_size=8)

    torch.manual_seed(seed)
    ctx = edge_context(build(), x, y, num_classes=C, test_size=40, seed=seed, builder=build)
    return FedTypeEdge(ctx)


def task(payloads: dict[str, Payload] | None = None, phase: str = "train", **cfg: Any) -> Task:
    base = {
        "proxy_model": "mlp_xs",
        "local_epochs": 2,
        "lr": 1e-3,
        "val_fraction": 0.25,
        "raps_k_reg": 2,
    }
    config = FedTypeConfig().replace(**{**base, **cfg})
    return Task(
        task_id="t",
        run_id="r",
        round=1,
        phase=phase,
        deadline=0.0,
        algorithm="fedtype",
        config=config.to_dict(),
        payloads=payloads or {},
    )


def test_only_the_proxy_is_uploaded_weighted_by_the_training_split() -> None:
    edge = make_edge()
    private = {k: v.clone() for k, v in edge.ctx.model.state_dict().items()}
    result = edge.handle(task())
    assert set(result.payloads) == {"weights"}
    w = result.payloads["weights"]
    assert isinstance(w, TensorMap)
    assert edge.proxy is not None
    own = edge.proxy.state_dict()
    assert set(w.tensors) == set(own)
    for name, value in w.tensors.items():
        np.testing.assert_array_equal(value, own[name].numpy())
    uploaded = {v.tobytes() for v in w.tensors.values()}
    assert not any(v.numpy().tobytes() in uploaded for v in edge.ctx.model.state_dict().values())
    assert any(not torch.equal(v, edge.ctx.model.state_dict()[k]) for k, v in private.items())
    assert result.num_samples == 160 - 40  # |D_i|: the calibration quarter is held out


def test_every_agent_starts_from_the_same_proxy_whatever_its_private_model() -> None:
    a, b = make_edge("mlp_s", seed=0), make_edge("cnn_t1", seed=1)
    ra = a.handle(task(local_epochs=0))
    rb = b.handle(task(local_epochs=0))
    wa, wb = ra.payloads["weights"], rb.payloads["weights"]
    assert isinstance(wa, TensorMap) and isinstance(wb, TensorMap)
    for name, value in wa.tensors.items():
        np.testing.assert_array_equal(value, wb.tensors[name])
    pa = next(iter(a.ctx.model.parameters()))
    assert pa.shape != next(iter(b.ctx.model.parameters())).shape


def test_the_received_global_proxy_is_trained_from() -> None:
    a, b = make_edge(seed=0), make_edge(seed=1)
    sent = a.handle(task()).payloads["weights"]
    assert isinstance(sent, TensorMap)
    result = b.handle(task({"weights": sent}, local_epochs=0))
    got = result.payloads["weights"]
    assert isinstance(got, TensorMap)
    for name, value in sent.tensors.items():
        np.testing.assert_array_equal(got.tensors[name], value)


def test_calibration_once_per_epoch_from_frozen_snapshots_on_the_held_out_split(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Prepare: spy on calibration and on every training batch
    edge = make_edge()
    calls: list[int] = []
    real = fedtype_edge.calibrate

    def spy(logits: torch.Tensor, labels: torch.Tensor, **kw: Any) -> Any:
        calls.append(len(labels))
        return real(logits, labels, **kw)

    monkeypatch.setattr(fedtype_edge, "calibrate", spy)
    seen: list[torch.Tensor] = []
    epochs: list[tuple[Any, dict[str, torch.Tensor]]] = []  # (conformal, live proxy at step)
    loss_of_step = edge.step_loss

    def step(x, y, features, logits):  # type: ignore[no-untyped-def]
        seen.append(x.flatten(1).clone())
        assert edge.proxy is not None
        live = {k: v.clone() for k, v in edge.proxy.state_dict().items()}
        epochs.append((edge.conformal, live))
        return loss_of_step(x, y, features, logits)

    edge.step_loss = step  # type: ignore[method-assign]
    # Execute: 3 epochs of 120 / 16 -> 8 batches
    metrics = edge.handle(task(local_epochs=3)).metrics
    # Assert: cp and cw calibrated on the 40 held-out samples at each epoch start, no more
    assert calls == [40] * 6
    distinct = []
    for conf, _ in epochs:
        if not distinct or conf is not distinct[-1]:
            distinct.append(conf)
    assert len(distinct) == 3 and len(epochs) == 24
    assert [i for i in range(1, 24) if epochs[i][0] is not epochs[i - 1][0]] == [8, 16]
    for first in (0, 8, 16):  # the snapshot is the proxy as the epoch began, and stays frozen
        conf, live = epochs[first]
        snap = conf.proxy.state_dict()
        assert all(torch.equal(snap[k], live[k]) for k in live)
        _, later = epochs[first + 7]
        assert any(not torch.equal(snap[k], later[k]) for k in later)
        assert not conf.proxy.training and not conf.private.training
    # the calibration split never reaches a gradient step
    assert edge.split is not None
    val = {tuple(r.tolist()) for r in edge.split.val.x.flatten(1)}
    assert not any(tuple(r.tolist()) in val for batch in seen for r in batch)
    assert metrics["bkd_skipped_epochs"] == 0 and metrics["sets_not_nested"] == 0


def test_round_metrics_are_in_range() -> None:
    edge = make_edge()
    m = edge.handle(task()).metrics
    for key in ("proxy_acc", "global_proxy_acc", "proxy_val_acc", "coverage_proxy", "mean_eta"):
        assert 0 <= m[key] <= 1, key
    assert 1 <= m["mean_set_size"] <= C and 1 <= m["mean_private_set_size"] <= C
    assert m["coverage_n"] == 2 * 40  # two epochs over the 40 test samples
    assert m["delta_first"] == 0.0  # never participated: Delta^1 = 0
    assert {"ce_private", "bkd", "ce_proxy", "fkd", "g_mean"} <= set(m)
    # Delta^1 of the next participation: D' accuracy of the received p_g minus the stored one
    up = edge.handle(task(lr=0.01, local_epochs=5)).payloads["weights"]  # a better proxy
    assert isinstance(up, TensorMap)
    zeros = TensorMap({k: np.zeros_like(v) for k, v in up.tensors.items()})  # predicts class 0
    stored = edge.a_stored
    assert edge.split is not None and stored is not None
    second = edge.handle(task({"weights": zeros}, local_epochs=1)).metrics
    zero_acc = float((edge.split.val.y == 0).float().mean())
    assert second["delta_first"] == pytest.approx(zero_acc - stored)
    assert zero_acc < stored  # aggregation "hurt" the proxy: g rises above lambda (Eq. 7)
    assert second["g_mean"] == pytest.approx(0.5 * (1 + stored - zero_acc))


@pytest.mark.parametrize(
    ("arm", "check"),
    [
        ({"eta_mode": "one"}, lambda m: m["mean_eta"] == 1.0),
        ({"bkd": "topk", "top_k": 3}, lambda m: m["mean_set_size"] == 3.0),
        ({"bkd": "symmetric"}, lambda m: "mean_eta" not in m and m["bkd"] > 0),
        ({"g_fn": "constant"}, lambda m: m["g_mean"] == 0.5),
        ({"bkd_form": "pairwise", "bkd_reduction": "mean_over_set"}, lambda m: m["bkd"] >= 0),
    ],
)
def test_ablation_arms_are_config_values(arm: dict[str, Any], check: Any) -> None:
    assert check(make_edge().handle(task(**arm)).metrics)


def test_too_small_a_calibration_split_skips_backward_kd() -> None:
    edge = make_edge(n=40)  # 25 % of 40 = 10 samples: ceil(11 * 0.9) = 10 <= 10, valid
    assert edge.handle(task()).metrics["bkd_skipped_epochs"] == 0
    edge = make_edge(n=32)  # 8 samples: k = 9 > 8
    m = edge.handle(task()).metrics
    assert m["bkd_skipped_epochs"] == 2 and m["bkd"] == 0.0 and "mean_eta" not in m


def _bkd_gradient(edge: FedTypeEdge) -> float:
    """The private model's gradient norm from the BKD term alone, after one calibration."""
    edge.handle(task(local_epochs=0))
    edge.cfg = edge.parse_config(task(local_epochs=1, bkd_form="pairwise"))
    edge._start_epoch()
    assert edge.conformal is not None and edge.conformal.valid
    x, y = edge.ctx.train.x[:32], edge.ctx.train.y[:32]
    model = edge.ctx.model
    model.zero_grad()
    logits = model.forward_head(model.forward_features(x))
    with_bkd = edge.step_loss(x, y, model.forward_features(x), logits)
    ce = torch.nn.functional.cross_entropy(logits, y)
    proxy, _ = edge._ready()
    zp = proxy(x)
    rest = ce + torch.nn.functional.cross_entropy(zp, y) + fedtype_edge.forward_kd(zp, logits, 1.0)
    (with_bkd - rest).backward()  # what the BKD term sends back
    return sum(float(p.grad.norm()) for p in model.parameters() if p.grad is not None)


def test_the_authors_arm_sends_no_bkd_gradient_to_the_private_model() -> None:
    paper = make_edge()
    assert _bkd_gradient(paper) > 0
    authors = make_edge()
    authors.handle(task(local_epochs=0))
    authors.cfg = authors.parse_config(task(bkd_private=False, bkd_form="pairwise"))
    authors._start_epoch()
    x, y = authors.ctx.train.x[:32], authors.ctx.train.y[:32]
    model = authors.ctx.model
    feats = model.forward_features(x)
    logits = model.forward_head(feats)
    loss = authors.step_loss(x, y, feats, logits)
    assert authors.stats["sum_bkd"] > 0  # computed (and reported) ...
    proxy, _ = authors._ready()
    zp = proxy(x)
    rest = torch.nn.functional.cross_entropy(logits, y) + torch.nn.functional.cross_entropy(zp, y)
    rest = rest + fedtype_edge.forward_kd(zp, logits, 1.0)
    assert loss.item() == pytest.approx(rest.item() + authors.stats["sum_bkd"], rel=1e-5)
    model.zero_grad()
    (loss - rest).backward()  # ... but its gradient reaches no parameter
    assert all(p.grad is None or float(p.grad.abs().sum()) == 0 for p in model.parameters())


def test_calibration_on_the_training_split_holds_nothing_out() -> None:
    held = make_edge()
    held.handle(task(local_epochs=0))
    _, split = held._ready()
    assert len(split.train) + len(split.val) == len(held.ctx.train) and len(split.val) > 0
    train = make_edge()
    train.handle(task(local_epochs=0, calibration_split="train"))
    _, split = train._ready()
    assert len(split.train) == len(split.val) == len(train.ctx.train)


@pytest.mark.parametrize(("draws", "calls"), [("independent", 2), ("shared", 1)])
def test_each_prediction_set_draws_its_own_u_unless_shared(
    monkeypatch: pytest.MonkeyPatch, draws: str, calls: int
) -> None:
    edge = make_edge()
    edge.handle(task(local_epochs=0))
    edge.cfg = edge.parse_config(task(raps_draws=draws))
    edge._start_epoch()
    assert edge.conformal is not None
    drawn: list[int] = []
    real = fedtype_edge.uniform

    def counted(n: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
        drawn.append(n)
        return real(n, gen, device)

    monkeypatch.setattr(fedtype_edge, "uniform", counted)
    edge._sets(edge.ctx.train.x[:16], edge.conformal)
    assert drawn == [16] * calls


def test_fedprox_adds_the_proximal_term_to_the_proxy_loss() -> None:
    edge = make_edge()
    edge.handle(task(local_epochs=0, proxy_fl="fedprox", prox_mu=0.5))
    proxy = edge.proxy
    assert proxy is not None and edge._anchor is not None
    edge._anchor = [torch.zeros_like(p) for p in proxy.parameters()]
    x, y = edge.ctx.train.x[:8], edge.ctx.train.y[:8]
    feats = edge.ctx.model.forward_features(x)
    logits = edge.ctx.model.forward_head(feats)
    with_prox = edge.step_loss(x, y, feats, logits)
    edge._anchor = None
    without = edge.step_loss(x, y, feats, logits)
    expect = 0.5 / 2 * sum(float(p.detach().pow(2).sum()) for p in proxy.parameters())
    assert with_prox.item() - without.item() == pytest.approx(expect, rel=1e-4)


def test_restart_restores_the_local_proxy_and_its_stored_accuracy() -> None:
    edge = make_edge()
    m = edge.handle(task()).metrics
    state = edge.extra_state()
    again = make_edge()
    again.load_extra_state(state)
    again.handle(task(phase="final"))  # builds the proxy from the checkpoint, trains nothing
    assert again.proxy is not None and edge.proxy is not None
    for k, v in edge.proxy.state_dict().items():
        assert torch.equal(v, again.proxy.state_dict()[k])
    assert again.a_stored == pytest.approx(m["proxy_val_acc"])


def test_final_phase_reports_local_and_global_proxy_accuracy() -> None:
    edge = make_edge()
    up = edge.handle(task()).payloads["weights"]
    assert isinstance(up, TensorMap)
    zeros = TensorMap({k: np.zeros_like(v) for k, v in up.tensors.items()})
    m = edge.handle(task({"weights": zeros}, phase="final")).metrics
    assert m["global_proxy_acc"] == pytest.approx(0.25)  # all-zero logits: class 0, 1 in 4
    assert edge.proxy is not None  # the local proxy is kept, not overwritten by p_g^T
    assert any(bool(p.abs().sum() > 0) for p in edge.proxy.parameters())
    assert "proxy_acc" in m


@pytest.mark.slow
def test_the_proxy_exports_and_verifies(tmp_path: Path) -> None:
    from export import export_bundle

    edge = make_edge()
    edge.handle(task())
    path = tmp_path / "proxy.ckpt"
    save_checkpoint(path, edge.proxy_checkpoint())
    x = edge.ctx.test.x[:16].numpy()
    manifest = export_bundle(
        path, tmp_path / "proxy", samples=x, labels=edge.ctx.test.y[:16].numpy()
    )
    fp32 = manifest.files[0]
    assert fp32.verification is not None and fp32.verification.passed
