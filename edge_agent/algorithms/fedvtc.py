"""FedVTC, edge half: train the model and a VTC generator, fine-tune on synthetic samples.

Each round (spec §2.3): receive the global prototypes of the classes held and the global SD;
for every mini-batch run step A (model on CE + L_tc, generator and sigma frozen) then step B
(generator and sigma on L_tc, model frozen); reply with local prototypes and sigma. After the
rounds: upload the generator once; receive the averaged generator with all prototypes; sample S
images per class and fine-tune the whole model on them, with no further communication.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edge_agent.algorithms.base import (
    EdgeAlgorithm,
    EdgeContext,
    PhaseResult,
    register_edge_algorithm,
)
from edge_agent.knowledge import class_prototypes, prototype_table
from edge_agent.seeding import seeded
from edge_agent.trainer import TensorData, TrainStats
from models.vtc import VTCGenerator, vtc_for
from protocol.algorithms.fedvtc import FedVTCConfig
from protocol.errors import ValidationError
from protocol.messages import Task
from protocol.payloads import Payload, PrototypeSet, TensorMap

__all__ = ["FedVTCEdge", "tc_losses", "tc_terms"]


def tc_terms(  # noqa: PLR0917 - the paper's symbols, in order
    x: Tensor,
    z: Tensor,
    x_gen: Tensor,
    z_gen: Tensor | None,
    protos: Tensor,
    mask: Tensor,
    rho: Tensor,
    kl_sigma_weight: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample ``L_rc``, ``KL`` and ``L_dm`` (spec §3), shapes ``[B]`` each.

    ``protos`` are the prototypes of each sample's label ``[B, p]``; ``mask`` zeroes the
    prototype terms of samples whose class has no global prototype yet (decision D3).
    """
    rc = (x_gen - x).pow(2).flatten(1).sum(1)
    p = z.shape[1]
    sigma_part = 0.5 * ((2 * rho).exp().sum() - p - (2 * rho).sum())
    kl = 0.5 * (z - protos).pow(2).sum(1) * mask + kl_sigma_weight * sigma_part
    dm = torch.zeros_like(rc) if z_gen is None else (z_gen - protos).pow(2).sum(1) * mask
    return rc, kl, dm


def tc_losses(  # noqa: PLR0917 - the paper's symbols, in order
    x: Tensor,
    z: Tensor,
    x_gen: Tensor,
    z_gen: Tensor | None,
    protos: Tensor,
    mask: Tensor,
    rho: Tensor,
    kl_sigma_weight: float,
) -> tuple[Tensor, Tensor]:
    """Per-sample ``L_rc + KL`` and ``L_dm`` (spec §3), shapes ``[B]`` each."""
    rc, kl, dm = tc_terms(x, z, x_gen, z_gen, protos, mask, rho, kl_sigma_weight)
    return rc + kl, dm


@register_edge_algorithm("fedvtc")
class FedVTCEdge(EdgeAlgorithm[FedVTCConfig]):
    """The edge half of FedVTC."""

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        p = ctx.model.num_features
        c, h, _ = ctx.train.x.shape[1:]
        self.generator: VTCGenerator = vtc_for(p, int(c), int(h)).to(ctx.device)
        self.rho = torch.zeros(p, device=ctx.device, requires_grad=True)  # log sigma (D2)
        self.table = torch.zeros(ctx.num_classes, p, device=ctx.device)
        self.valid = torch.zeros(ctx.num_classes, dtype=torch.bool, device=ctx.device)
        counts = torch.tensor(ctx.class_counts, dtype=torch.float32, device=ctx.device)
        # class-balanced weights w_y = n_k / |D_k^y| (D4); absent classes never occur in batches
        self.class_weight = torch.where(counts > 0, counts.sum() / counts.clamp(min=1), 0.0)
        self.generator_trained = False
        # latent noise from the agent's own seeded stream: runs are reproducible per device
        self.noise = torch.Generator(device=ctx.device).manual_seed(
            int(ctx.generator.initial_seed())
        )
        self._finetuning = False
        self._gen_opt: torch.optim.Optimizer | None = None
        self._diag: dict[str, list[float]] = {}  # per-round loss terms when diagnostics is on

    def phases(self) -> dict[str, Callable[[Task], PhaseResult]]:
        """``train`` rounds, the one-shot ``upload_generator``, and ``final`` (fine-tune)."""
        return {
            "train": self.train_phase,
            "upload_generator": self.upload_phase,
            "final": self.final_phase,
        }

    # ----- knowledge in ---------------------------------------------------------------------
    def receive(self, payloads: dict[str, Payload]) -> None:
        """Global prototypes (+ SD in ``protos.sd``) and, when sent, the global generator."""
        protos = payloads.get("protos")
        if protos is not None:
            if not isinstance(protos, PrototypeSet):
                raise ValidationError("payloads.protos", "protos", type(protos).KIND)
            self._take_prototypes(protos)
        gen = payloads.get("generator")
        if gen is not None:
            if not isinstance(gen, TensorMap):
                raise ValidationError("payloads.generator", "tensors", type(gen).KIND)
            self._load_generator(gen)

    def _take_prototypes(self, protos: PrototypeSet) -> None:
        p = self.table.shape[1]
        too_big = protos.class_ids.size and int(protos.class_ids.max()) >= self.ctx.num_classes
        if protos.class_ids.size and (protos.dim != p or too_big):
            raise ValidationError(
                "payloads.protos",
                f"dim {p} and ids < {self.ctx.num_classes}",
                (protos.dim, protos.class_ids.tolist()),
            )
        table, valid = prototype_table(protos, self.ctx.num_classes, self.ctx.device)
        self.table = torch.where(valid.unsqueeze(1), table, self.table)
        self.valid |= valid
        if protos.sd is not None:
            if protos.sd.shape != (p,):
                raise ValidationError("payloads.protos.sd", f"shape [{p}]", list(protos.sd.shape))
            sd = torch.as_tensor(protos.sd, device=self.ctx.device)
            with torch.no_grad():  # sigma_k <- global sigma (Algorithm line 9)
                self.rho.copy_(sd.clamp(self.config.sd_min, self.config.sd_max).log())

    def _load_generator(self, gen: TensorMap) -> None:
        own = self.generator.state_dict()
        if set(gen.tensors) != set(own):
            raise ValidationError(
                "payloads.generator",
                f"the {len(own)} tensors of the VTC generator",
                sorted(set(gen.tensors) ^ set(own))[:5],
            )
        self.generator.load_state_dict(
            {
                k: torch.as_tensor(v).to(own[k].dtype).reshape(own[k].shape)
                for k, v in gen.tensors.items()
            }
        )

    # ----- the loop hooks -------------------------------------------------------------------
    def _targets(self, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        protos = self.table[y]
        if self.config.init_protos == "mask":
            mask = self.valid[y].float()
        else:
            mask = torch.ones_like(y, dtype=torch.float32)
        return protos, mask, self.class_weight[y]

    def _reduce(self, per_sample: Tensor, y: Tensor, weight: Tensor) -> Tensor:
        mode = self.config.tc_reduction
        if mode == "mean":
            return per_sample.mean()
        if mode == "classbalanced":
            return (weight * per_sample).mean()
        classes = torch.unique(y)  # classsum_batch: sum over classes of the in-batch class mean
        return torch.stack([per_sample[y == c].mean() for c in classes]).sum()

    def _tc(self, x: Tensor, y: Tensor, z: Tensor, log: bool = False) -> Tensor:
        protos, mask, weight = self._targets(y)
        sigma = self.rho.exp()
        v = z + sigma * torch.randn(z.shape, device=z.device, generator=self.noise)
        x_gen = self.generator(v)
        z_gen = self.ctx.model.forward_features(x_gen) if self.config.use_dm else None
        rc, kl, dm = tc_terms(
            x, z, x_gen, z_gen, protos, mask, self.rho, self.config.kl_sigma_weight
        )
        if self.config.tc_scale == "per_dim":  # means over pixels / latent dims, not sums
            rc, kl, dm = rc / x[0].numel(), kl / z.shape[1], dm / z.shape[1]
        if log:  # diagnostics: the reduced size of each term, to compare with CE
            with torch.no_grad():
                for name, term in (("rc", rc), ("kl", kl), ("dm", dm)):
                    self._log(name, self._reduce(term, y, weight))
        return self._reduce(rc + kl + self.config.dm_weight * dm, y, weight)

    def _log(self, name: str, value: Tensor | float) -> None:
        self._diag.setdefault(name, []).append(float(value))

    def step_loss(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> Tensor:
        """Step A: CE + L_tc with the generator and sigma frozen (plain CE while fine-tuning)."""
        ce = F.cross_entropy(logits, y)
        if self._finetuning:
            return ce
        _set_trainable(self.generator, False)
        self.rho.requires_grad_(False)
        self.generator.eval()
        log = self.config.diagnostics
        tc = self._tc(x, y, features, log=log)
        if log:
            self._log("ce", ce.detach())
            self._log("tc", tc.detach())
        return ce + self.config.model_tc_weight * tc

    def after_step(self, x: Tensor, y: Tensor, features: Tensor) -> None:
        """Step B: generator and sigma on L_tc with the model frozen (eval mode)."""
        if self._finetuning or self._gen_opt is None:
            return
        model = self.ctx.model
        _set_trainable(self.generator, True)
        self.rho.requires_grad_(True)
        _set_trainable(model, False)
        model.eval()
        self.generator.train()
        with torch.no_grad():
            z = model.forward_features(x)
        loss = self._tc(x, y, z)
        if torch.isfinite(loss):
            self._gen_opt.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)
            if self.config.grad_clip > 0:
                nn.utils.clip_grad_norm_(
                    [*self.generator.parameters(), self.rho], self.config.grad_clip
                )
            self._gen_opt.step()
            with torch.no_grad():
                self.rho.clamp_(math.log(self.config.sd_min), math.log(self.config.sd_max))
            self.generator_trained = True
        _set_trainable(model, True)
        model.train()

    # ----- phases ---------------------------------------------------------------------------
    def train_phase(self, task: Task) -> PhaseResult:
        """One federated round (step A/B alternation per mini-batch)."""
        cfg = self.config
        if not self.generator_trained:  # before the first step; a received global SD wins
            if cfg.shared_generator_init:
                self._shared_init(cfg.generator_seed)
            with torch.no_grad():
                self.rho.fill_(math.log(cfg.sd_init))
        lr = cfg.generator_lr or cfg.lr
        self._gen_opt = torch.optim.SGD([*self.generator.parameters(), self.rho], lr=lr)
        self._diag = {}
        try:
            result = super().train_phase(task)
        finally:
            _set_trainable(self.generator, True)
            self.rho.requires_grad_(True)
        result.metrics["sigma_mean"] = float(self.rho.detach().exp().mean())
        if cfg.diagnostics:
            result.metrics.update(self._round_diagnostics())
        return result

    def _shared_init(self, seed: int) -> None:
        """psi's initial weights from ``seed`` alone, identical on every client, so that the
        one-shot average of the trained generators is an average of related networks."""
        with seeded(seed):  # exclusive among simulated agents; global RNG restored after
            fresh = vtc_for(
                self.generator.latent_dim, self.generator.out_chans, self.generator.out_size
            )
        self.generator.load_state_dict(fresh.state_dict())

    @torch.no_grad()
    def _round_diagnostics(self) -> dict[str, float]:
        """Why the generator does (not) carry class content: loss scales, the geometry of
        features vs the latent noise, and the range of the generator's output."""
        out = {f"diag_{k}": sum(v) / len(v) for k, v in self._diag.items() if v}
        rng_state = self.ctx.generator.get_state()  # diagnostics must not move the batch order
        local = class_prototypes(self.ctx.model, self.ctx.train, self.ctx.num_classes)
        vec = torch.as_tensor(local.vectors)
        out["diag_sigma_norm"] = float(self.rho.exp().norm())
        out["diag_proto_norm"] = float(vec.norm(dim=1).mean()) if len(vec) else 0.0
        if len(vec) > 1:  # mean distance between this client's class prototypes
            d = torch.cdist(vec, vec)
            out["diag_proto_sep"] = float(d.sum() / (len(vec) * (len(vec) - 1)))
        held = self.valid.nonzero().flatten()
        if held.numel():
            out["diag_global_proto_norm"] = float(self.table[held].norm(dim=1).mean())
        out.update({f"diag_{k}": v for k, v in self._generator_stats(8).items()})
        self.ctx.generator.set_state(rng_state)
        return out

    @torch.no_grad()
    def _generator_stats(self, per_class: int) -> dict[str, float]:
        """Range of psi(c^y + sigma*eps) and its class contrast: the pixel std of the class
        means over the mean within-class pixel std (near 0 = the class does not matter)."""
        data = self.synthesize(per_class, source="generator")
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

    def reply_payloads(self) -> dict[str, Payload]:
        """Local prototypes of the held classes and sigma (and the generator if every round)."""
        protos = class_prototypes(self.ctx.model, self.ctx.train, self.ctx.num_classes)
        sd = self.rho.detach().exp().cpu().numpy()
        out: dict[str, Payload] = {
            "protos": PrototypeSet(
                protos.class_ids,
                protos.vectors,
                protos.counts,
                sd=sd,
                encoding=self.config.proto_encoding,
            )
        }
        if self.config.generator_exchange == "every_round":
            out["generator"] = self._generator_payload()
        return out

    def _generator_payload(self) -> TensorMap:
        tensors = {k: v.detach().cpu().numpy() for k, v in self.generator.state_dict().items()}
        return TensorMap(tensors, encoding=self.config.generator_encoding)

    def upload_phase(self, task: Task) -> PhaseResult:
        """The one-shot generator upload (M3)."""
        return PhaseResult(
            {"generator": self._generator_payload()},
            {"generator_trained": float(self.generator_trained)},
            len(self.ctx.train),
        )

    def final_phase(self, task: Task) -> PhaseResult:
        """Receive psi, all prototypes and sigma; fine-tune on S synthetic samples per class."""
        own = copy.deepcopy(self.generator.state_dict()) if self.config.diagnostics else None
        self.receive(task.payloads)
        if self.config.generator_bn_recalibrate:
            self._recalibrate_bn(max(self.config.synthetic_per_class, 32))
        before = self._eval_metrics("before_ft")
        synthetic = self.synthesize(self.config.synthetic_per_class)
        if len(synthetic) == 0:
            return PhaseResult(metrics=before, num_samples=0)
        diagnostics = self._diagnostics(synthetic, own) if own is not None else {}
        stats = self._finetune(synthetic)
        metrics = {
            **before,
            **diagnostics,
            "finetune_loss": stats.mean_loss,
            "synthetic_samples": float(len(synthetic)),
        }
        return PhaseResult(metrics=metrics, num_samples=len(synthetic))

    @torch.no_grad()
    def _recalibrate_bn(self, per_class: int) -> None:
        """Re-estimate psi's BN running statistics (cumulative average over batches of decoded
        latents of every valid class); only latents are used, no data (the REPAIR/"reset BN"
        remedy for the variance collapse of averaged networks)."""
        bns = [m for m in self.generator.modules() if isinstance(m, nn.BatchNorm2d)]
        classes = self.valid.nonzero().flatten()
        if not bns or classes.numel() == 0:
            return
        y = classes.repeat_interleave(per_class)
        eps = torch.randn((len(y), self.table.shape[1]), generator=self.ctx.generator)
        v = self.table[y] + self.rho.exp() * eps.to(self.ctx.device)
        momenta = [m.momentum for m in bns]
        for m in bns:
            m.reset_running_stats()
            m.momentum = None  # cumulative moving average over the batches below
        self.generator.train()
        for chunk in torch.split(v[torch.randperm(len(v), generator=self.ctx.generator)], 256):
            self.generator(chunk)
        for m, momentum in zip(bns, momenta, strict=True):
            m.momentum = momentum
        self.generator.eval()

    def _finetune(self, data: TensorData) -> TrainStats:
        self._finetuning = True
        try:
            return self.local_train(data, epochs=self.config.finetune_epochs)
        finally:
            self._finetuning = False

    def _diagnostics(self, synthetic: TensorData, own: dict[str, Tensor]) -> dict[str, float]:
        """Noise control and synthetic-only probe (spec §10.1), on copies: the model is untouched.

        Also the probe on this client's *own* generator (before averaging) and the range and
        class contrast of the generated images. The agent's random stream is restored after, so
        the fine-tuning itself is the same as without diagnostics.
        """
        model = self.ctx.model
        saved = copy.deepcopy(model.state_dict())
        rng_state = self.ctx.generator.get_state()
        noise_x = torch.rand(synthetic.x.shape, generator=self.ctx.generator)
        noise = TensorData(noise_x.to(self.ctx.device), synthetic.y)
        self._finetune(noise)
        out = {
            k.replace("before_ft", "noise_control"): v
            for k, v in self._eval_metrics("before_ft").items()
        }
        model.load_state_dict(saved)
        out.update(self._probe(synthetic))
        out.update(self._generator_stats(8))
        averaged = copy.deepcopy(self.generator.state_dict())
        self.generator.load_state_dict(own)
        mine = self._probe(self.synthesize(self.config.synthetic_per_class))
        out.update({f"{k}_own_gen": v for k, v in mine.items()})
        out.update({f"{k}_own_gen": v for k, v in self._generator_stats(8).items()})
        self.generator.load_state_dict(averaged)
        self.ctx.generator.set_state(rng_state)
        return out

    def _probe(self, synthetic: TensorData) -> dict[str, float]:
        from edge_agent.trainer import evaluate, make_optimizer, train_epochs
        from models import create_model

        c, h, _ = synthetic.x.shape[1:]
        with seeded(self.ctx.generator.initial_seed()):  # global RNG restored after
            probe = create_model(
                "mlp_m", num_classes=self.ctx.num_classes, in_chans=int(c), input_size=int(h)
            ).to(self.ctx.device)
        cfg = self.config.replace(optimizer="adam", lr=1e-3, grad_clip=0.0)
        train_epochs(
            probe,
            synthetic,
            cfg,
            _CrossEntropy(),
            optimizer=make_optimizer(list(probe.parameters()), cfg),
            epochs=max(5, self.config.finetune_epochs),
            generator=self.ctx.generator,
        )
        out = {"probe_acc_local": evaluate(probe, self.ctx.test).accuracy}
        if self.ctx.global_test is not None:
            out["probe_acc_global"] = evaluate(probe, self.ctx.global_test).accuracy
        return {k: v for k, v in out.items() if not math.isnan(v)}

    @torch.no_grad()
    def synthesize(self, per_class: int, source: str | None = None) -> TensorData:
        """S samples per class with a valid prototype: x' = psi(c^y + sigma * eps) (eval mode).

        ``source`` overrides ``finetune_source`` ("generator" or "noise")."""
        classes = self.valid.nonzero().flatten()
        if classes.numel() == 0:
            return TensorData(self.ctx.train.x[:0], self.ctx.train.y[:0])
        y = classes.repeat_interleave(per_class)
        gen = self.ctx.generator
        if (source or self.config.finetune_source) == "noise":  # control: same labels, no content
            x = torch.rand((len(y), *self.ctx.train.x.shape[1:]), generator=gen).to(self.ctx.device)
            return TensorData(x, y)
        self.generator.eval()
        eps = torch.randn((len(y), self.table.shape[1]), generator=gen).to(self.ctx.device)
        v = self.table[y] + self.rho.exp() * eps
        x = torch.cat([self.generator(chunk) for chunk in torch.split(v, 512)])
        return TensorData(x, y)

    def _eval_metrics(self, suffix: str) -> dict[str, float]:
        from edge_agent.trainer import evaluate

        model = self.ctx.model
        out = {f"acc_local_{suffix}": evaluate(model, self.ctx.test, self.scores).accuracy}
        if self.ctx.global_test is not None:
            out[f"acc_global_{suffix}"] = evaluate(
                model, self.ctx.global_test, self.scores
            ).accuracy
        return {k: v for k, v in out.items() if not math.isnan(v)}  # drop NaN (empty test set)

    # ----- state ----------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Tensor]:
        """Generator, log-sigma and the prototype table survive restarts."""
        state = {f"generator.{k}": v.detach().cpu() for k, v in self.generator.state_dict().items()}
        state.update(
            rho=self.rho.detach().cpu(),
            proto_table=self.table.cpu(),
            proto_valid=self.valid.cpu(),
            generator_trained=torch.tensor(self.generator_trained),
        )
        return state

    def load_extra_state(self, state: dict[str, Tensor]) -> None:
        """Restore :meth:`extra_state`."""
        gen = {
            k.removeprefix("generator."): v for k, v in state.items() if k.startswith("generator.")
        }
        if gen:
            self.generator.load_state_dict(gen)
        if "rho" in state:
            with torch.no_grad():
                self.rho.copy_(state["rho"].to(self.ctx.device))
        if "proto_table" in state and state["proto_table"].shape == self.table.shape:
            self.table = state["proto_table"].to(self.ctx.device)
            self.valid = state["proto_valid"].to(self.ctx.device).bool()
        if "generator_trained" in state:
            self.generator_trained = bool(state["generator_trained"])


class _CrossEntropy:
    """Plain CE hooks for the probe classifier."""

    def step_loss(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> Tensor:
        return F.cross_entropy(logits, y)

    def after_step(self, x: Tensor, y: Tensor, features: Tensor) -> None:
        return None


def _set_trainable(module: nn.Module, flag: bool) -> None:
    for p in module.parameters():
        p.requires_grad_(flag)
