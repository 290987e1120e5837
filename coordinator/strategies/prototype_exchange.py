"""Server halves that keep global class prototypes: sent to every agent, checked in every
reply (FedProto averages them, FedTGP trains a generator on them)."""

from __future__ import annotations

from typing import Any

from coordinator.strategies.base import AgentInfo, PhaseHooks, ServerContext, Step, Strategy
from protocol.contract.messages import Reply
from protocol.contract.payloads import Payload, PrototypeSet

__all__ = ["PrototypeExchangeStrategy"]


class PrototypeExchangeStrategy(Strategy[Any]):
    """Global prototypes down, the agents' class prototypes up; subclasses fold the uploads
    into new global prototypes (:meth:`fold_prototypes`)."""

    def __init__(self, config: Any, *, num_classes: int, seed: int = 0) -> None:
        super().__init__(config, num_classes=num_classes, seed=seed)
        self.protos: PrototypeSet | None = None

    def phase_hooks(self) -> dict[str, PhaseHooks]:
        """Training rounds exchange prototypes; ``final`` sends the last global ones."""
        return {
            "train": PhaseHooks(
                self.send_prototypes, self.check_upload, self.fold_prototypes, self.train_server
            ),
            "final": PhaseHooks(configure=self.send_prototypes),
        }

    def send_prototypes(self, step: Step, agent: AgentInfo) -> dict[str, Payload]:
        """Global prototypes (all known classes: FedProto also uses them at inference)."""
        return {} if self.protos is None else {"protos": self.protos}

    def check_upload(self, step: Step, agent: AgentInfo, reply: Reply) -> None:
        """Prototypes of the agent's own classes, within ``max_abs_feature``, with the fleet's
        feature dimension (:meth:`~Strategy.expected_dim`)."""
        dim = self.expected_dim(self.held_dim(self.protos), self.config.feature_dim)
        self.check_prototypes(agent, reply, "protos", dim)

    def fold_prototypes(
        self, step: Step, replies: list[tuple[AgentInfo, Reply]]
    ) -> dict[str, float]:
        """Fold a round's uploads into the global state (default: nothing)."""
        return {}

    def train_server(self, step: Step, ctx: ServerContext) -> dict[str, float]:
        """Server training after a round (default: none)."""
        return {}

    def state_dict(self) -> dict[str, Payload]:
        """The global prototypes."""
        return {} if self.protos is None else {"protos": self.protos}

    def load_state_dict(self, state: dict[str, Payload]) -> None:
        """Restore the global prototypes."""
        p = state.get("protos")
        self.protos = p if isinstance(p, PrototypeSet) else None
