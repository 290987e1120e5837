"""FedTGP, server half: the round's uploaded prototypes train the global-prototype generator.

``aggregate`` keeps the round's client prototypes and computes the adaptive margin from their
per-class means (each class's distance to its nearest other class; the margin is the largest of
these, capped at ``margin_threshold``); ``server_train`` then continues training the TGP on
them with the margin-enhanced contrastive loss (``coordinator/strategies/fedtgp/server.py``) and
its outputs
become the global prototypes sent down. Classes no agent has uploaded yet get no prototype.

In a buffered run each client's prototypes weigh its reply's staleness weight, both in the
class means behind the margin and in the generator's loss.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from coordinator.class_stats import mean_prototypes, screen_metrics, weighted_pairs
from coordinator.strategies.base import AgentInfo, ServerContext, Step, register_strategy
from coordinator.strategies.prototype_exchange import PrototypeExchangeStrategy
from protocol.algorithms.fedtgp import FedTGPConfig
from protocol.contract.messages import Reply
from protocol.contract.payloads import Payload, PrototypeSet, TensorMap
from protocol.errors import AggregationError

__all__ = ["FedTGPStrategy", "adaptive_margin"]


def adaptive_margin(means: PrototypeSet, threshold: float) -> float:
    """``min(max_c min_{k != c} ||m_c - m_k||, threshold)`` over the classes in ``means``
    (the threshold when fewer than two classes are present)."""
    if means.class_ids.size < 2:
        return float(threshold)
    v = means.vectors.astype(np.float64)
    dist = np.sqrt(((v[:, None, :] - v[None, :, :]) ** 2).sum(-1))
    np.fill_diagonal(dist, np.inf)
    return float(min(dist.min(axis=1).max(), threshold))


def _counts(protos: PrototypeSet) -> dict[int, int]:
    return {int(c): int(n) for c, n in zip(protos.class_ids, protos.counts, strict=True)}


@register_strategy("fedtgp")
class FedTGPStrategy(PrototypeExchangeStrategy):
    """Global prototypes from a server-trained generator (validation and ``configure`` as
    FedProto's)."""

    stale_replies = "weighted"  # staleness weights in the margin's means and the TGP's loss

    config: FedTGPConfig

    def __init__(self, config: FedTGPConfig, *, num_classes: int, seed: int = 0) -> None:
        super().__init__(config, num_classes=num_classes, seed=seed)
        self.tgp: TensorMap | None = None  # the generator's state dict (torch stays lazy)
        # the round's uploads (pairs, labels, pair weights, margin), consumed by server_train
        # in the same step
        self._pending: (
            tuple[npt.NDArray[np.float32], npt.NDArray[np.int64], npt.NDArray[np.float64], float]
            | None
        ) = None
        self._counts: dict[int, int] = {}

    def fold_prototypes(
        self, step: Step, replies: list[tuple[AgentInfo, Reply]]
    ) -> dict[str, float]:
        """Keep every (client prototype, class) pair of the round, each weighing its reply's
        staleness weight, and the adaptive margin."""
        sets = [self.payload(r, "protos", PrototypeSet) for _, r in replies]
        weights = [self.reply_weight(r) for _, r in replies]
        # checks dimensions agree; the margin comes from these class centres (robust under
        # `aggregation`); the generator trains on the pairs `upload_screen` keeps
        means = mean_prototypes(None, sets, self.num_classes, rule=self.robust, weights=weights)
        if means is None:
            self._pending = None
            return {"uploaded_prototypes": 0.0}
        vectors, labels, pair_weights, screened = weighted_pairs(
            sets, weights, self.config.upload_screen
        )
        margin = adaptive_margin(means, self.config.margin_threshold)
        self._pending = (vectors, labels, pair_weights, margin)
        self._counts.update(_counts(means))
        out = {"uploaded_prototypes": float(len(labels) + screened), "margin": margin}
        return out | screen_metrics(self.config.upload_screen, screened)

    def train_server(self, step: Step, ctx: ServerContext) -> dict[str, float]:
        """Train the TGP on the round's prototypes; its outputs for every class uploaded so far
        become the global prototypes."""
        if self._pending is None:
            return {}
        vectors, labels, pair_weights, margin = self._pending
        self._pending = None
        from coordinator.strategies.fedtgp.server import (
            train_prototypes,  # torch only on the server's path
        )
        from models.fit import FitError

        try:
            self.tgp, table, metrics = train_prototypes(
                self.tgp,
                vectors,
                labels,
                margin=margin,
                num_classes=self.num_classes,
                cfg=self.config,
                ctx=ctx,
                weights=pair_weights,
            )
        except FitError as exc:  # the engine closes the step failed and keeps the last state
            raise AggregationError(f"fedtgp: prototype training failed: {exc}") from exc
        ids = np.array(sorted(self._counts), np.int32)
        counts = np.array([self._counts[c] for c in ids.tolist()], np.int32)
        self.protos = PrototypeSet(ids, table[ids], counts, encoding=self.config.proto_encoding)
        return metrics

    def state_dict(self) -> dict[str, Payload]:
        """The global prototypes and the generator."""
        out = super().state_dict()
        if self.tgp is not None:
            out["tgp"] = self.tgp
        return out

    def load_state_dict(self, state: dict[str, Payload]) -> None:
        """Restore the prototypes (and the classes they cover) and the generator."""
        super().load_state_dict(state)
        tgp = state.get("tgp")
        self.tgp = tgp if isinstance(tgp, TensorMap) else None
        self._counts = {} if self.protos is None else _counts(self.protos)
        self._pending = None
