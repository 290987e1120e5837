"""Felo, Velo and FedHe, edge half (``shared/specs/felo_velo.md`` §2.3 and §3).

The three differ only in configuration (and, for Velo, in what the server sends), so one class
serves all three names. A participation: take the group model (same-architecture averaging) and
the server's per-class knowledge, train with the one loop on
``CE + kd_weight * (MSE(s, S[y]) + KL(softmax P[y] || softmax p))``, masked to samples whose
class has server knowledge (§8-D10), while accumulating per-class sums of the features and
logits of the training forward passes themselves (no second pass over the data), and upload
their means with the model. Under ``hyper.dp`` with ``same_arch_avg`` the model trains by
DP-SGD and the sums come from one pass after it (docs/concepts/privacy.md).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from edge_agent.algorithms.base import (
    EdgeContext,
    PhaseResult,
    TaskPayloads,
    received,
    register_edge_algorithm,
    task_payloads,
)
from edge_agent.algorithms.weights import WeightExchangeEdge
from edge_agent.class_stats import ClassMeans, ClassReservoir, class_output_sums
from models.seeding import derived_seed
from protocol.contract.arrays import Encoding
from protocol.contract.messages import Task
from protocol.contract.payloads import FeatureLogitSet, Payload
from protocol.errors import ValidationError

__all__ = ["FeatureLogitEdge", "FedHeEdge", "FeloEdge", "VeloEdge", "felo_kd_loss"]


def felo_kd_loss(  # noqa: PLR0917 - the terms of Eq. (1), in order
    features: Tensor,
    logits: Tensor,
    server_features: Tensor,
    server_logits: Tensor,
    use_features: bool = True,
    use_logits: bool = True,
    kl_reduction: str = "elementwise_mean",
) -> Tensor:
    """The KD part of Eq. (1) for samples whose class has knowledge (rows already matched):
    ``MSE(s, S)`` (mean over elements) + ``KL(softmax S_p || softmax p)`` (mean over elements,
    the authors' code, or per sample with ``batchmean``)."""
    loss = features.new_zeros(())
    if use_features:
        loss = loss + F.mse_loss(features.float(), server_features)
    if use_logits:
        kl = F.kl_div(
            F.log_softmax(logits.float(), dim=1), F.softmax(server_logits, dim=1), reduction="sum"
        )
        # spelled out: torch's reduction="mean" is to change meaning in a future release
        loss = loss + kl / (logits.numel() if kl_reduction == "elementwise_mean" else len(logits))
    return loss


class FeatureLogitEdge(WeightExchangeEdge[Any]):
    """Class-wise features and logits both ways; the group model when averaging is on. Every
    agent of one architecture starts from the same weights (inherited ``shared_modules``), so a
    group's first average is one of related networks."""

    DP_SUMS: ClassVar[int] = 2  # the features' sums and the logits'

    TASK_PAYLOADS: ClassVar[TaskPayloads] = task_payloads(
        {"knowledge": FeatureLogitSet}, inherited=WeightExchangeEdge.TASK_PAYLOADS
    )

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        c, d, dev = ctx.num_classes, ctx.model.num_features, ctx.device
        self.server_features = torch.zeros(c, d, device=dev)
        self.server_logits = torch.zeros(c, c, device=dev)
        self.valid = torch.zeros(c, dtype=torch.bool, device=dev)
        self._features = ClassMeans(c, d, dev)  # this participation's training passes
        self._logits = ClassMeans(c, c, dev)

    # ----- knowledge in ---------------------------------------------------------------------
    def receive(self, payloads: dict[str, Payload]) -> None:
        """Overwrite the model with the group model; take the server's per-class knowledge
        (absent during warm-up: then no KD this participation)."""
        super().receive(payloads)  # the group model, when the task carries one
        knowledge = received(payloads, "knowledge", FeatureLogitSet)
        if knowledge is None:
            self.valid.zero_()
            return
        self._take(knowledge)

    def _take(self, k: FeatureLogitSet) -> None:
        c, d = self.server_logits.shape[0], self.server_features.shape[1]
        if k.class_ids.size and (
            k.features.shape[1] != d or k.logits.shape[1] != c or int(k.class_ids.max()) >= c
        ):
            raise ValidationError(
                "payloads.knowledge",
                f"features of dim {d}, logits of {c} classes, ids < {c}",
                (k.features.shape, k.logits.shape, k.class_ids.tolist()),
            )
        ids = torch.as_tensor(k.class_ids, dtype=torch.long, device=self.ctx.device)
        self.valid.zero_()
        self.valid[ids] = True
        self.server_features[ids] = torch.as_tensor(k.features, device=self.ctx.device)
        self.server_logits[ids] = torch.as_tensor(k.logits, device=self.ctx.device)

    # ----- the loop's hooks -----------------------------------------------------------------
    def train_phase(self, task: Task) -> PhaseResult:
        """One participation; the statistics restart with it."""
        self._features.reset(self.dp_clip())
        self._logits.reset(self.dp_clip())
        return super().train_phase(task)

    def step_loss(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> Tensor:
        """Eq. (1): CE plus the masked KD terms."""
        loss = F.cross_entropy(logits, y)
        mask = self.valid[y]
        cfg = self.config
        if cfg.kd_weight > 0 and bool(mask.any()):
            ym = y[mask]
            kd = felo_kd_loss(
                features[mask],
                logits[mask],
                self.server_features[ym],
                self.server_logits[ym],
                cfg.use_features,
                cfg.use_logits,
                cfg.kl_reduction,
            )
            if self._dp_sgd is not None:
                # DP-SGD needs a mean over the batch of each sample's own loss: the KD terms
                # average over the masked samples, which would make one sample's gradient
                # depend on how many others of the batch have knowledge
                kd = kd * (int(mask.sum()) / len(y))
            loss = loss + cfg.kd_weight * kd
        return loss

    def after_step(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> None:
        """Per-class sums of this step's (pre-update, train-mode) features and logits (not
        under DP-SGD: :meth:`reply_payloads` takes them in one pass after the steps)."""
        if self._dp_sgd is None:
            self._features.add(features, y)
            self._logits.add(logits, y)

    # ----- knowledge out --------------------------------------------------------------------
    def reply_payloads(self) -> dict[str, Payload]:
        """Class-wise means of the participation; the whole model when averaging is on.

        Under DP-SGD (``same_arch_avg`` with ``hyper.dp``) the batches were Poisson-sampled, so
        a sample may have been drawn any number of times: the sums are taken instead in one
        pass over the training data with the trained model (eval mode), each sample added
        once, and released as such."""
        contributions = self.config.local_epochs
        if self.dp_clip() > 0 and self.config.dp_sgd_trains():
            ctx = self.ctx
            sums = class_output_sums(ctx.model, ctx.train, ctx.num_classes, clip=self.dp_clip())
            self._features, self._logits = sums
            contributions = 1
        self.release([self._features, self._logits], contributions)
        present = self._features.present()
        out: dict[str, Payload] = {
            "knowledge": FeatureLogitSet(
                class_ids=present.cpu().numpy(),
                features=self._features.means(present).cpu().numpy(),
                logits=self._logits.means(present).cpu().numpy(),
                counts=self._features.counts[present].cpu().numpy(),
                encoding=self.config.knowledge_encoding,
            )
        }
        if self.config.same_arch_avg:
            out.update(super().reply_payloads())
        return out

    def weight_encoding(self) -> Encoding:
        """As the run configures (``weight_encoding``)."""
        return self.config.weight_encoding  # type: ignore[no-any-return]

    def extra_state(self) -> dict[str, Tensor]:
        """The server knowledge survives restarts."""
        return {
            "server_features": self.server_features.cpu(),
            "server_logits": self.server_logits.cpu(),
            "server_valid": self.valid.cpu(),
        }

    def load_extra_state(self, state: dict[str, Tensor]) -> None:
        """Restore the server knowledge if it fits this model."""
        super().load_extra_state(state)  # restored weights: no common start over them
        f, p, v = (state.get(k) for k in ("server_features", "server_logits", "server_valid"))
        if f is None or p is None or v is None or f.shape != self.server_features.shape:
            return
        dev = self.ctx.device
        self.server_features, self.server_logits, self.valid = (
            f.to(dev),
            p.to(dev),
            v.to(dev).bool(),
        )


@register_edge_algorithm("felo")
class FeloEdge(FeatureLogitEdge):
    """Felo: features and logits, same-architecture averaging (by its config)."""


@register_edge_algorithm("velo")
class VeloEdge(FeatureLogitEdge):
    """Velo: the server's features are CVAE samples. With ``upload_samples`` > 0 the edge also
    uploads a uniform sample of its training passes' individual features (at most that many
    per class), from which the CVAE learns their distribution."""

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        seed = derived_seed(int(ctx.generator.initial_seed()), "velo-samples")
        self._sample_stream = torch.Generator().manual_seed(seed)
        self._samples: ClassReservoir | None = None

    def random_streams(self) -> dict[str, torch.Generator]:
        """The batch order's and the feature sample's."""
        return super().random_streams() | {"velo_samples": self._sample_stream}

    def train_phase(self, task: Task) -> PhaseResult:
        """One participation; the sample restarts with it."""
        size = int(self.config.upload_samples)
        c = self.ctx.num_classes
        self._samples = ClassReservoir(c, size, self._sample_stream) if size > 0 else None
        return super().train_phase(task)

    def after_step(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> None:
        """The class sums, and the sample of individual features."""
        super().after_step(x, y, features, logits)
        if self._samples is not None:
            self._samples.add(features.detach(), y)

    def reply_payloads(self) -> dict[str, Payload]:
        """Felo's, and the sample when one is asked for."""
        out = super().reply_payloads()
        if self._samples is not None:
            dim = self.ctx.model.num_features
            out["samples"] = self._samples.payload(dim, self.config.knowledge_encoding)
        return out


@register_edge_algorithm("fedhe")
class FedHeEdge(FeatureLogitEdge):
    """FedHe: logits only, no weight averaging (by its config)."""
