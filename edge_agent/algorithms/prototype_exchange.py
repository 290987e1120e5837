"""The edge half of prototype exchange (FedProto, FedTGP): CE + lambda * MSE(feature, global
prototype of its label), class prototypes up; prediction by the head, or the nearest or the most
aligned global prototype."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from edge_agent.algorithms.base import (
    EdgeAlgorithm,
    EdgeContext,
    PhaseResult,
    SharedModule,
    TaskPayloads,
    received,
    task_payloads,
)
from edge_agent.algorithms.weights import SHARED_MODEL_SEED, shared_head
from edge_agent.class_stats import (
    ClassMeans,
    class_feature_sums,
    merge_prototypes,
    prototype_scores,
)
from edge_agent.dp import clip_rows
from edge_agent.trainer import TensorData, TrainStats, evaluate
from models.checkpoint import HeadSpec
from protocol.algorithms.fedproto import FedProtoConfig
from protocol.contract.messages import Task
from protocol.contract.payloads import Payload, PrototypeSet

__all__ = ["PrototypeExchangeEdge"]


class PrototypeExchangeEdge(EdgeAlgorithm[FedProtoConfig]):
    """CE + lambda * MSE(feature, global prototype of its label); uploads class prototypes."""

    TASK_PAYLOADS: ClassVar[TaskPayloads] = task_payloads({"protos": PrototypeSet})

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        dim = ctx.model.num_features
        self.table = torch.zeros(ctx.num_classes, dim, device=ctx.device)
        self.valid = torch.zeros(ctx.num_classes, dtype=torch.bool, device=ctx.device)
        self._received: dict[str, float] = {}
        self._seen: ClassMeans | None = None  # proto_source = training: this round's features
        self._reg_clip = 0.0  # > 0: the regulariser compares features clipped to it

    def receive(self, payloads: dict[str, Payload]) -> None:
        """Global prototypes of (some) classes; absent classes stay masked."""
        protos = received(payloads, "protos", PrototypeSet)
        if protos is None:
            return
        self.table, self.valid = merge_prototypes(self.table, self.valid, protos)

    def train_phase(self, task: Task) -> PhaseResult:
        """The base phase, plus ``acc_local_received``: HtFLlib's evaluation order (before local
        training, with the global prototypes just received, built from the same models' uploads)."""
        self._received = {}
        result = super().train_phase(task)
        result.metrics.update(self._received)
        return result

    def local_train(self, data: TensorData, epochs: int | None = None) -> TrainStats:
        """Evaluate the previous round's model with the fresh prototypes, then train.

        The agent's own evaluation comes after training, when the prototypes are one round
        older than the model; this one is the accuracy HtFLlib reports.
        """
        if self.predicts_by_prototype() and len(self.ctx.test):
            fresh = evaluate(self.ctx.model, self.ctx.test, self.scores)
            self._received = {"acc_local_received": fresh.accuracy}
        self._reg_clip = self.dp_clip() if self.config.dp_regulariser == "clipped" else 0.0
        if self.config.proto_source == "training":
            dim, dev = self.table.shape[1], self.ctx.device
            self._seen = ClassMeans(self.ctx.num_classes, dim, dev, self.dp_clip())
        return super().local_train(data, epochs)

    def after_step(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> None:
        """``proto_source = training``: count the step's features under their labels."""
        if self._seen is not None:
            self._seen.add(features, y)

    def predicts_by_prototype(self) -> bool:
        """Whether ``scores`` uses the prototypes now: configured so and any are known."""
        return self.cfg is not None and self.cfg.predict != "head" and bool(self.valid.any())

    def shared_modules(self) -> dict[str, SharedModule]:
        """``shared_init``: the model from one seed per architecture (HtFLlib's start), then
        (``head``) the head from one seed per head shape, alike across architectures."""
        mode = self.config.shared_init
        if mode == "none":
            return {}
        shared = {"model": self.shared_model(SHARED_MODEL_SEED)}
        if mode == "head":
            # FedTGP shares this edge; its head seed stays FedProto's
            shared["head"] = shared_head(self.ctx.model.get_classifier(), "fedproto")
        return shared

    def step_loss(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> Tensor:
        """CE plus the prototype distance for samples whose class has a global prototype."""
        loss = F.cross_entropy(logits, y)
        mask = self.valid[y]
        if bool(mask.any()):
            mine = features[mask]
            if self._reg_clip > 0:
                mine = clip_rows(mine, self._reg_clip)
            loss = loss + self.config.proto_weight * F.mse_loss(mine, self.table[y[mask]])
        return loss

    def reply_payloads(self) -> dict[str, Payload]:
        """Local prototypes of the classes this device holds: of the trained model, or of the
        features its training computed (``proto_source``)."""
        encoding = self.config.proto_encoding
        seen, self._seen = self._seen, None
        if seen is not None and bool(seen.counts.any()):
            self.release([seen], self.config.local_epochs)
            return {"protos": seen.prototypes(encoding)}
        model, train = self.ctx.model, self.ctx.train
        sums = class_feature_sums(model, train, self.ctx.num_classes, clip=self.dp_clip())
        self.release([sums], 1)
        return {"protos": sums.prototypes(encoding)}

    def scores(self, x: Tensor) -> Tensor:
        """Head logits, or the global prototypes' scores (``predict``: ``prototype``, negative
        squared distances; ``cosine``, cosine similarities)."""
        if self.predicts_by_prototype():
            features = self.ctx.model.forward_features(x)
            return prototype_scores(features, self.table, self.valid, self._prototype_head())
        out: Tensor = self.ctx.model(x)
        return out

    def head_spec(self) -> HeadSpec:
        """The prototype (or cosine) head when the run predicts by prototype, else plain
        logits."""
        if self.predicts_by_prototype():
            kind = self._prototype_head()
            return HeadSpec(type=kind, prototypes=self.table.cpu(), valid=self.valid.cpu())
        return HeadSpec(type="logits", prototypes=None, valid=None)

    def _prototype_head(self) -> Literal["prototype", "cosine"]:
        """The export head, and the scores, of the configured prototype prediction."""
        return "cosine" if self.config.predict == "cosine" else "prototype"

    def extra_state(self) -> dict[str, Tensor]:
        """The global prototype table survives restarts."""
        return {"proto_table": self.table.cpu(), "proto_valid": self.valid.cpu()}

    def load_extra_state(self, state: dict[str, Tensor]) -> None:
        """Restore the prototype table if it fits this model."""
        super().load_extra_state(state)
        table, valid = state.get("proto_table"), state.get("proto_valid")
        if table is not None and valid is not None and table.shape == self.table.shape:
            self.table, self.valid = table.to(self.ctx.device), valid.to(self.ctx.device).bool()
