"""FedGen, edge half: CE plus the head's CE on generated features of sampled labels.

The head goes up as ``weights`` (and the mean head comes down, with ``head_exchange``); the
generator and the fleet's label counts come down every round after the first. Per batch the
agent draws ``batch_size`` labels from the label counts and uniform noise from its own seeded
stream, runs the generator without gradients (BatchNorm on batch statistics, as the server
trained it) and adds ``gen_weight * CE(head(z), labels)``: only the head learns from it.
"""

from __future__ import annotations

from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edge_agent.algorithms.base import (
    EdgeContext,
    SharedModule,
    TaskPayloads,
    received,
    register_edge_algorithm,
    task_payloads,
)
from edge_agent.algorithms.weights import WeightExchangeEdge, load_tensormap, shared_head
from models.feature_gen import feature_generator
from models.seeding import blank
from protocol.algorithms.fedgen import FedGenConfig
from protocol.contract.arrays import Encoding
from protocol.contract.payloads import Payload, TensorMap
from protocol.errors import ValidationError

__all__ = ["FedGenEdge", "build_generator"]


build_generator = feature_generator  # the one layout, shared with the other half


@register_edge_algorithm("fedgen")
class FedGenEdge(WeightExchangeEdge[FedGenConfig]):
    """The edge half of FedGen."""

    TASK_PAYLOADS: ClassVar[TaskPayloads] = task_payloads(
        {"generator": TensorMap, "labels": TensorMap}, inherited=WeightExchangeEdge.TASK_PAYLOADS
    )

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        self.generator: nn.Sequential | None = None
        self.label_probs: Tensor | None = None
        self.noise = torch.Generator(device=ctx.device).manual_seed(
            int(ctx.generator.initial_seed())
        )

    def exchanged_module(self) -> nn.Module:
        """The classifier head."""
        return self.ctx.model.get_classifier()

    def random_streams(self) -> dict[str, torch.Generator]:
        """The batch order's and the generated features' (labels and latent noise)."""
        return super().random_streams() | {"fedgen_noise": self.noise}

    def weight_encoding(self) -> Encoding:
        """As the run configures (``head_encoding``)."""
        return self.config.head_encoding

    def shared_modules(self) -> dict[str, SharedModule]:
        """``shared_head``: the head from one seed fleet-wide; else none (each agent's own)."""
        if not self.config.shared_head:
            return {}
        return {"head": shared_head(self.exchanged_module(), self.name)}

    def receive(self, payloads: dict[str, Payload]) -> None:
        """The mean head (``weights``), the generator and the label counts."""
        super().receive(payloads)
        gen, labels = (
            received(payloads, "generator", TensorMap),
            received(payloads, "labels", TensorMap),
        )
        if gen is None:
            return
        if labels is None:
            raise ValidationError("payloads.labels", "tensors with the generator", "nothing")
        counts = torch.as_tensor(labels.tensors.get("counts", []), dtype=torch.float64)
        if counts.shape != (self.ctx.num_classes,) or float(counts.sum()) <= 0:
            raise ValidationError(
                "payloads.labels.counts",
                f"[{self.ctx.num_classes}] counts, some > 0",
                list(counts.shape),
            )
        cfg = self.config
        dims = (cfg.noise_dim, self.ctx.num_classes, cfg.hidden_dim, self.ctx.model.num_features)
        net = blank(lambda: build_generator(*dims))  # loaded next
        load_tensormap(net, gen, "payloads.generator")
        self.generator = net.to(self.ctx.device)
        self.label_probs = (counts / counts.sum()).float().to(self.ctx.device)

    def generated_loss(self, batch: int) -> Tensor | None:
        """CE of the head on ``batch`` generated features (None before a generator arrives)."""
        if self.generator is None or self.label_probs is None:
            return None
        labels = torch.multinomial(self.label_probs, batch, replacement=True, generator=self.noise)
        noise = torch.rand(
            (batch, self.config.noise_dim), generator=self.noise, device=self.ctx.device
        )
        self.generator.train()  # batch statistics, as on the server
        with torch.no_grad():
            onehot = F.one_hot(labels, self.ctx.num_classes).float()
            z = cast(Tensor, self.generator(torch.cat([noise, onehot], dim=1)))
        return F.cross_entropy(self.ctx.model.forward_head(z), labels)

    def step_loss(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> Tensor:
        """CE on the batch plus ``gen_weight`` times the head's CE on generated features."""
        loss = F.cross_entropy(logits, y)
        extra = self.generated_loss(max(self.config.batch_size, 2))  # BatchNorm needs two
        return loss if extra is None else loss + self.config.gen_weight * extra
