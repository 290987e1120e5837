"""FedVTC, edge half: train the model and a VTC generator, fine-tune on synthetic samples.

Each round (spec §2.3): receive the global prototypes of the classes held and the global SD;
for every mini-batch run step A (model on CE + L_tc, generator and sigma frozen) then step B
(generator and sigma on L_tc, model frozen); reply with local prototypes and sigma. After the
rounds: upload the generator once; receive the averaged generator with all prototypes; sample S
images per class and fine-tune the whole model on them, with no further communication.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edge_agent.algorithms.base import (
    EdgeAlgorithm,
    EdgeContext,
    PhaseResult,
    SharedModule,
    TaskPayloads,
    received,
    register_edge_algorithm,
    task_payloads,
)
from edge_agent.algorithms.fedvtc_diagnostics import final_diagnostics, round_diagnostics
from edge_agent.algorithms.weights import load_tensormap, module_to_tensormap
from edge_agent.class_stats import class_prototypes, merge_prototypes
from edge_agent.trainer import ParamGroup, TensorData, TrainStats, evaluate
from models.vtc import VTCGenerator, vtc_for
from protocol.algorithms.fedvtc import FedVTCConfig
from protocol.contract.messages import Task
from protocol.contract.payloads import Payload, PrototypeSet, TensorMap
from protocol.errors import ConfigError, ValidationError

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


def _generator_for(p: int, chans: int, size: int) -> VTCGenerator:
    """psi for ``p``-dimensional prototypes, or a refusal that names the feature size to give
    the fleet (the model's own size rarely fits the reshape, e.g. 64 or 512 at 28x28)."""
    try:
        return vtc_for(p, chans, size)
    except ConfigError as exc:
        if size % 4:
            raise
        cells = (size // 4) ** 2
        fit = -(-p // cells) * cells
        raise ConfigError(
            f"{exc}: fedvtc decodes the {p}-d features into {chans}x{size}x{size} images, so "
            f"every device needs a feature size that is a multiple of {cells}: give the fleet "
            f"--feature-dim {fit} (coordinator simulate / demo, or each edge-agent)"
        ) from exc


@register_edge_algorithm("fedvtc")
class FedVTCEdge(EdgeAlgorithm[FedVTCConfig]):
    """The edge half of FedVTC."""

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        p = ctx.model.num_features
        c, h, _ = ctx.train.x.shape[1:]
        self.generator: VTCGenerator = _generator_for(p, int(c), int(h)).to(ctx.device)
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
        self.diag_terms: dict[str, list[float]] = {}  # per-round loss terms (diagnostics on)

    TASK_PAYLOADS: ClassVar[TaskPayloads] = task_payloads(
        {"protos": PrototypeSet, "generator": TensorMap}, ("train", "upload_generator", "final")
    )

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
        protos = received(payloads, "protos", PrototypeSet)
        if protos is not None:
            self._take_prototypes(protos)
        gen = received(payloads, "generator", TensorMap)
        if gen is not None:
            load_tensormap(self.generator, gen, "payloads.generator")

    def _take_prototypes(self, protos: PrototypeSet) -> None:
        self.table, self.valid = merge_prototypes(self.table, self.valid, protos)
        p = self.table.shape[1]
        if protos.sd is not None:
            if protos.sd.shape != (p,):
                raise ValidationError("payloads.protos.sd", f"shape [{p}]", list(protos.sd.shape))
            sd = torch.as_tensor(protos.sd, device=self.ctx.device)
            with torch.no_grad():  # sigma_k <- global sigma (Algorithm line 9)
                self.rho.copy_(sd.clamp(self.config.sd_min, self.config.sd_max).log())

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
        self.diag_terms.setdefault(name, []).append(float(value))

    def param_groups(self) -> list[ParamGroup]:
        """Step A trains the model; step B, after it on every batch, the generator and sigma on
        L_tc, the model frozen in eval mode. Fine-tuning: the model.

        ``grad_clip_mode = "split"`` clips the head apart from the extractor and psi apart from
        sigma; ``generator_mode_step_a = "train"`` keeps psi's BatchNorm on batch statistics
        while step A backpropagates through it with its gradients off."""
        if self._finetuning:
            return super().param_groups()
        cfg = self.config
        step_b = functools.partial(
            ParamGroup,
            lr=cfg.generator_lr or cfg.lr,
            optimizer="sgd",
            momentum=0.0,
            weight_decay=0.0,
            loss=self._generator_loss,
            frozen_mode=cfg.generator_mode_step_a,
        )
        if cfg.grad_clip_mode == "joint":  # one norm over the model, one over psi and sigma
            return [
                *super().param_groups(),
                step_b(
                    "generator",
                    self.generator,
                    params=[*self.generator.parameters(), self.rho],
                    after_update=self._clamp_sigma,
                ),
            ]
        # the loop clips each group on its own; psi and sigma share one loss, so one sub-step
        model = self.ctx.model
        head = model.get_classifier()
        in_head = {id(p) for p in head.parameters()}
        extractor = [p for p in model.parameters() if id(p) not in in_head]
        sigma_module = nn.Module()  # sigma has no module; its own gives the loop one to set
        return [
            ParamGroup("extractor", model, params=extractor),
            ParamGroup("head", head),
            step_b("generator", self.generator),
            step_b("sigma", sigma_module, params=[self.rho], after_update=self._clamp_sigma),
        ]

    def step_loss(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> Tensor:
        """Step A: CE + L_tc (the loop froze the generator's and sigma's gradients); CE while
        fine-tuning."""
        ce = F.cross_entropy(logits, y)
        if self._finetuning:
            return ce
        log = self.config.diagnostics
        tc = self._tc(x, y, features, log=log)
        if log:
            self._log("ce", ce.detach())
            self._log("tc", tc.detach())
        return ce + self.config.model_tc_weight * tc

    def _generator_loss(self, x: Tensor, y: Tensor) -> Tensor | None:
        """Step B's L_tc on features of the model step A just updated (frozen, eval mode); a
        non-finite batch is skipped rather than ending the round."""
        with torch.no_grad():
            z = self.ctx.model.forward_features(x)
        loss = self._tc(x, y, z)
        if not torch.isfinite(loss):
            return None
        self.generator_trained = True  # the loop steps on a finite loss right away
        return loss

    @torch.no_grad()
    def _clamp_sigma(self) -> None:  # after each step B update: sigma within [sd_min, sd_max]
        self.rho.clamp_(math.log(self.config.sd_min), math.log(self.config.sd_max))

    # ----- phases ---------------------------------------------------------------------------
    def train_phase(self, task: Task) -> PhaseResult:
        """One federated round (step A/B alternation per mini-batch)."""
        cfg = self.config
        if not self.generator_trained:  # before the first step; a received global SD wins
            with torch.no_grad():
                self.rho.fill_(math.log(cfg.sd_init))
        self.diag_terms = {}
        result = super().train_phase(task)
        result.metrics["sigma_mean"] = float(self.rho.detach().exp().mean())
        if cfg.diagnostics:
            result.metrics.update(round_diagnostics(self))
        return result

    def shared_modules(self) -> dict[str, SharedModule]:
        """psi's initial weights from ``generator_seed`` alone, identical on every client, so
        that the one-shot average of the trained generators is an average of related networks.
        """
        if not self.config.shared_generator_init:
            return {}
        g = self.generator
        build = functools.partial(vtc_for, g.latent_dim, g.out_chans, g.out_size)
        return {"generator": SharedModule(g, build, self.config.generator_seed)}

    def needs_shared_init(self) -> bool:
        """Until the generator has trained (a restored trained generator is kept)."""
        return not self.generator_trained

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
            out["generator"] = self.generator_payload()
        return out

    def generator_payload(self) -> TensorMap:
        """psi's state dict (BN buffers included) as the ``generator`` payload."""
        return module_to_tensormap(self.generator, self.config.generator_encoding)

    def upload_phase(self, task: Task) -> PhaseResult:
        """The one-shot generator upload (M3)."""
        return PhaseResult(
            {"generator": self.generator_payload()},
            {"generator_trained": float(self.generator_trained)},
            len(self.ctx.train),
        )

    def final_phase(self, task: Task) -> PhaseResult:
        """Receive psi, all prototypes and sigma; fine-tune on S synthetic samples per class."""
        own = copy.deepcopy(self.generator.state_dict()) if self.config.diagnostics else None
        self.receive(task.payloads)
        if self.config.generator_bn_recalibrate:
            self._recalibrate_bn(max(self.config.synthetic_per_class, 32))
        before = self.eval_metrics("before_ft")
        synthetic = self.synthesize(self.config.synthetic_per_class)
        if len(synthetic) == 0:
            return PhaseResult(metrics=before, num_samples=0)
        diagnostics = final_diagnostics(self, synthetic, own) if own is not None else {}
        stats = self.finetune(synthetic)
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

    def finetune(self, data: TensorData) -> TrainStats:
        """The model alone, plain CE, ``finetune_epochs`` over ``data`` (the one loop)."""
        self._finetuning = True
        try:
            return self.local_train(data, epochs=self.config.finetune_epochs)
        finally:
            self._finetuning = False

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

    def eval_metrics(self, suffix: str) -> dict[str, float]:
        """Local and global test accuracy as ``acc_local_<suffix>`` / ``acc_global_<suffix>``."""
        model = self.ctx.model
        out = {f"acc_local_{suffix}": evaluate(model, self.ctx.test, self.scores).accuracy}
        if self.ctx.global_test is not None:
            out[f"acc_global_{suffix}"] = evaluate(
                model, self.ctx.global_test, self.scores
            ).accuracy
        return {k: v for k, v in out.items() if not math.isnan(v)}  # drop NaN (empty test set)

    # ----- state ----------------------------------------------------------------------------
    def random_streams(self) -> dict[str, torch.Generator]:
        """The batch order's and the generator's latent noise."""
        return super().random_streams() | {"fedvtc_noise": self.noise}

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
        super().load_extra_state(state)
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
