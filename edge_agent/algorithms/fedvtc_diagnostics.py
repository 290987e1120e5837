"""FedVTC's diagnostics (spec §10.1), beside the algorithm rather than inside it.

Why the generator does (not) carry class content: per-round loss scales and feature geometry,
the range and class contrast of generated images, the noise control (fine-tune on uniform noise
with the same labels) and the synthetic-only probe (a fresh classifier trained on synthetic
images alone). Everything runs on copies or restores what it touched, and puts the agent's
random stream back, so a run with diagnostics trains exactly as one without.
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from edge_agent.class_stats import class_prototypes
from edge_agent.trainer import TensorData, evaluate, train_epochs
from models.seeding import seeded

if TYPE_CHECKING:
    from edge_agent.algorithms.fedvtc import FedVTCEdge

__all__ = ["final_diagnostics", "generator_stats", "probe", "round_diagnostics"]


@torch.no_grad()
def round_diagnostics(edge: FedVTCEdge) -> dict[str, float]:
    """Loss scales of the round, the geometry of features vs the latent noise, and the range of
    the generator's output, as ``diag_*`` metrics."""
    out = {f"diag_{k}": sum(v) / len(v) for k, v in edge.diag_terms.items() if v}
    ctx = edge.ctx
    rng_state = ctx.generator.get_state()  # diagnostics must not move the batch order
    local = class_prototypes(ctx.model, ctx.train, ctx.num_classes)
    vec = torch.as_tensor(local.vectors)
    out["diag_sigma_norm"] = float(edge.rho.exp().norm())
    out["diag_proto_norm"] = float(vec.norm(dim=1).mean()) if len(vec) else 0.0
    if len(vec) > 1:  # mean distance between this client's class prototypes
        d = torch.cdist(vec, vec)
        out["diag_proto_sep"] = float(d.sum() / (len(vec) * (len(vec) - 1)))
    held = edge.valid.nonzero().flatten()
    if held.numel():
        out["diag_global_proto_norm"] = float(edge.table[held].norm(dim=1).mean())
    out.update({f"diag_{k}": v for k, v in generator_stats(edge, 8).items()})
    ctx.generator.set_state(rng_state)
    return out


@torch.no_grad()
def generator_stats(edge: FedVTCEdge, per_class: int) -> dict[str, float]:
    """Range of psi(c^y + sigma*eps) and its class contrast: the pixel std of the class means
    over the mean within-class pixel std (near 0 = the class does not matter)."""
    data = edge.synthesize(per_class, source="generator")
    if len(data) == 0:
        return {}
    x = data.x.flatten(1)
    classes = torch.unique(data.y)
    means = torch.stack([x[data.y == c].mean(0) for c in classes])
    within = (
        torch.stack([x[data.y == c].std(0) for c in classes]).mean()
        if per_class > 1
        else x.new_tensor(0.0)
    )
    between = means.std(0).mean() if len(classes) > 1 else x.new_tensor(0.0)
    return {
        "gen_min": float(x.min()),
        "gen_max": float(x.max()),
        "gen_std": float(x.std()),
        "gen_class_contrast": float(between / within.clamp(min=1e-8)),
    }


def final_diagnostics(
    edge: FedVTCEdge, synthetic: TensorData, own: dict[str, Tensor]
) -> dict[str, float]:
    """Noise control and synthetic-only probe, on copies: the model is untouched.

    Also the probe on this client's *own* generator ``own`` (its state before averaging) and
    the range and class contrast of the generated images. The agent's random stream is
    restored after, so the fine-tuning itself is the same as without diagnostics.
    """
    ctx = edge.ctx
    saved = copy.deepcopy(ctx.model.state_dict())
    rng_state = ctx.generator.get_state()
    noise_x = torch.rand(synthetic.x.shape, generator=ctx.generator)
    edge.finetune(TensorData(noise_x.to(ctx.device), synthetic.y))
    out = {
        k.replace("before_ft", "noise_control"): v
        for k, v in edge.eval_metrics("before_ft").items()
    }
    ctx.model.load_state_dict(saved)
    out.update(probe(edge, synthetic))
    out.update(generator_stats(edge, 8))
    averaged = copy.deepcopy(edge.generator.state_dict())
    edge.generator.load_state_dict(own)
    mine = probe(edge, edge.synthesize(edge.config.synthetic_per_class))
    out.update({f"{k}_own_gen": v for k, v in mine.items()})
    out.update({f"{k}_own_gen": v for k, v in generator_stats(edge, 8).items()})
    edge.generator.load_state_dict(averaged)
    ctx.generator.set_state(rng_state)
    return out


def probe(edge: FedVTCEdge, synthetic: TensorData) -> dict[str, float]:
    """Accuracy of a fresh ``mlp_m`` trained (Adam, no clipping) on ``synthetic`` alone."""
    from models import create_model

    ctx = edge.ctx
    c, h, _ = synthetic.x.shape[1:]
    with seeded(ctx.generator.initial_seed()):  # global RNG restored after
        net = create_model(
            "mlp_m", num_classes=ctx.num_classes, in_chans=int(c), input_size=int(h)
        ).to(ctx.device)
    cfg = edge.config.replace(optimizer="adam", lr=1e-3, grad_clip=0.0)
    epochs = max(5, edge.config.finetune_epochs)
    train_epochs(net, synthetic, cfg, _CrossEntropy(), epochs=epochs, generator=ctx.generator)
    out = {"probe_acc_local": evaluate(net, ctx.test).accuracy}
    if ctx.global_test is not None:
        out["probe_acc_global"] = evaluate(net, ctx.global_test).accuracy
    return {k: v for k, v in out.items() if not math.isnan(v)}


class _CrossEntropy:
    """Plain CE hooks for the probe classifier."""

    def step_loss(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> Tensor:
        return F.cross_entropy(logits, y)

    def after_step(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> None:
        return None
