"""FedGH, server half: a global head trained on the uploaded class prototypes.

``aggregate`` keeps every (client prototype, class) pair of the round; ``server_train`` continues
training the global head ``Linear(D, C)`` on them with cross-entropy
(``coordinator/strategies/head_training.py:fit_head``, the one server fit loop); ``configure``
sends it down
as ``weights`` (the state dict of the agents' classifier), which each agent loads before
training. In a buffered run each client prototype's loss term weighs its reply's staleness
weight.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from coordinator.class_stats import screen_metrics, weighted_pairs
from coordinator.strategies.base import (
    AgentInfo,
    PhaseHooks,
    ServerContext,
    Step,
    Strategy,
    register_strategy,
)
from protocol.algorithms.fedgh import FedGHConfig
from protocol.contract.messages import Reply
from protocol.contract.payloads import Payload, PrototypeSet, TensorMap
from protocol.errors import AggregationError

__all__ = ["FedGHStrategy"]


@register_strategy("fedgh")
class FedGHStrategy(Strategy[FedGHConfig]):
    """The server half of FedGH."""

    stale_replies = "weighted"  # staleness weights in the head's loss

    def __init__(self, config: FedGHConfig, *, num_classes: int, seed: int = 0) -> None:
        super().__init__(config, num_classes=num_classes, seed=seed)
        self.head: TensorMap | None = None  # ``weight`` [C, D], ``bias`` [C]
        # the round's (prototypes, classes, staleness weights) for server_train
        self._pending: (
            tuple[npt.NDArray[np.float32], npt.NDArray[np.int64], npt.NDArray[np.float64]] | None
        ) = None

    @property
    def feature_dim(self) -> int | None:
        """The head's input size once it exists."""
        return None if self.head is None else int(self.head.tensors["weight"].shape[1])

    def phase_hooks(self) -> dict[str, PhaseHooks]:
        """Training rounds: prototypes up, the head trained on them down; ``final``: the head."""
        return {
            "train": PhaseHooks(
                self.send_head, self.check_upload, self.keep_prototypes, self.train_head
            ),
            "final": PhaseHooks(configure=self.send_head),
        }

    def send_head(self, step: Step, agent: AgentInfo) -> dict[str, Payload]:
        """The global head (none before the first server training)."""
        return {} if self.head is None else {"weights": self.head}

    def check_upload(self, step: Step, agent: AgentInfo, reply: Reply) -> None:
        """Prototypes of the agent's classes, of the head's input size (before the head: the
        fleet's registered size)."""
        self.check_prototypes(agent, reply, "protos", self.expected_dim(self.feature_dim))

    def keep_prototypes(
        self, step: Step, replies: list[tuple[AgentInfo, Reply]]
    ) -> dict[str, float]:
        """Keep the round's (prototype, class) pairs, each with its reply's staleness weight,
        for :meth:`server_train`."""
        sets = [self.payload(r, "protos", PrototypeSet) for _, r in replies]
        weights = [self.reply_weight(r) for _, r in replies]
        vectors, labels, rows, screened = weighted_pairs(sets, weights, self.config.upload_screen)
        self._pending = (vectors, labels, rows) if labels.size else None
        out = {"uploaded_prototypes": float(labels.size + screened)}
        return out | screen_metrics(self.config.upload_screen, screened)

    def train_head(self, step: Step, ctx: ServerContext) -> dict[str, float]:
        """Continue training the global head on the round's prototypes (fresh SGD)."""
        if self._pending is None:
            return {}
        vectors, labels, weights = self._pending
        self._pending = None
        from coordinator.strategies.head_training import (  # torch only on the server's path
            fit_head,
            shared_start_head,
        )
        from models.fit import FitError

        cfg = self.config
        head = self.head
        if head is None and cfg.shared_head:  # the agents' shared start, not a fresh draw
            head = shared_start_head(self.name, int(vectors.shape[1]), self.num_classes)
        try:
            self.head, metrics = fit_head(
                head,
                vectors,
                labels,
                num_classes=self.num_classes,
                epochs=cfg.server_epochs,
                batch_size=cfg.server_batch_size,
                lr=cfg.server_lr,
                ctx=ctx,
                encoding=cfg.head_encoding,
                weights=weights,
            )
        except FitError as exc:  # the engine closes the step failed and keeps the last state
            raise AggregationError(f"fedgh: head training failed: {exc}") from exc
        return metrics

    def state_dict(self) -> dict[str, Payload]:
        """The global head."""
        return {} if self.head is None else {"head": self.head}

    def load_state_dict(self, state: dict[str, Payload]) -> None:
        """Restore the global head."""
        head = state.get("head")
        self.head = head if isinstance(head, TensorMap) else None
        self._pending = None
