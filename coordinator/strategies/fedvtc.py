"""FedVTC, server half: per-class prototype means, SD mean, one-shot generator averaging.

Plan: T training rounds (prototypes + SD both ways, only the classes each agent holds), then
``upload_generator`` (every agent once, spec M3), then ``final`` (the averaged generator, all
prototypes and the SD to everyone, who fine-tune locally and report, spec M4).
"""

from __future__ import annotations

import numpy as np

from coordinator.aggregation import reduce_rows
from coordinator.class_stats import mean_prototypes
from coordinator.strategies.base import (
    AgentInfo,
    PhaseHooks,
    Step,
    Strategy,
    register_strategy,
)
from protocol.algorithms.fedvtc import FedVTCConfig
from protocol.contract.messages import Reply
from protocol.contract.payloads import Payload, PrototypeSet, TensorMap
from protocol.errors import ValidationError

__all__ = ["FedVTCStrategy"]


@register_strategy("fedvtc")
class FedVTCStrategy(Strategy[FedVTCConfig]):
    """The server half of FedVTC."""

    unbuffered_reason = "its later phases depend on one another in lock-step"

    def __init__(self, config: FedVTCConfig, *, num_classes: int, seed: int = 0) -> None:
        super().__init__(config, num_classes=num_classes, seed=seed)
        self.protos: PrototypeSet | None = None  # global c^y of classes ever prototyped + sigma
        self.generator: TensorMap | None = None

    def final_steps(self, rounds: int) -> list[Step]:
        """One-shot generator upload, then broadcast and local fine-tuning."""
        return [Step(rounds + 1, "upload_generator", "all"), Step(rounds + 1, "final", "all")]

    def phase_hooks(self) -> dict[str, PhaseHooks]:
        """Training: prototypes of the agent's classes + sigma, both ways (and generators every
        round); ``upload_generator``: the one-shot generator mean; ``final``: everything +
        generator.

        Payload keys and kinds of replies were checked by the engine
        (``FedVTCConfig.REPLY_PAYLOADS``); every value is within the bounds.
        """
        return {
            "train": PhaseHooks(self._configure_train, self._validate_train, self.mean_uploads),
            "upload_generator": PhaseHooks(
                validate=self._validate_upload, aggregate=self.aggregate_generators
            ),
            "final": PhaseHooks(configure=self._configure_final),
        }

    def _configure_train(self, step: Step, agent: AgentInfo) -> dict[str, Payload]:
        out: dict[str, Payload] = {}
        if self.protos is not None:
            out["protos"] = self._subset(self.protos, agent.classes)
        if self.config.generator_exchange == "every_round" and self.generator is not None:
            out["generator"] = self.generator
        return out

    def _configure_final(self, step: Step, agent: AgentInfo) -> dict[str, Payload]:
        return self.state_dict()  # all prototypes with sigma, and the averaged generator

    def _subset(self, protos: PrototypeSet, classes: list[int]) -> PrototypeSet:
        keep = np.isin(protos.class_ids, classes)
        return PrototypeSet(
            protos.class_ids[keep],
            protos.vectors[keep],
            protos.counts[keep],
            sd=protos.sd,
            encoding=self.config.proto_encoding,
        )

    def _validate_train(self, step: Step, agent: AgentInfo, reply: Reply) -> None:
        """Prototypes with an SD of the fleet's dimension (:meth:`~Strategy.expected_dim`);
        generators with the known layout."""
        dim = self.expected_dim(self.held_dim(self.protos), self.config.feature_dim)
        protos = self.check_prototypes(agent, reply, "protos", dim)
        if protos.sd is None:
            raise ValidationError("reply.payloads.protos.sd", "the agent's SD vector", None)
        if protos.sd.shape[0] != protos.dim and protos.class_ids.size:
            raise ValidationError(
                "reply.payloads.protos.sd", f"length {protos.dim}", protos.sd.shape[0]
            )
        if self.config.generator_exchange == "every_round":  # optional in the schema only
            self._validate_upload(step, agent, reply)

    def _validate_upload(self, step: Step, agent: AgentInfo, reply: Reply) -> None:
        """A generator with the fleet's layout."""
        gen = self.payload(reply, "generator", TensorMap)
        if self.generator is not None and set(gen.tensors) != set(self.generator.tensors):
            raise ValidationError(
                "reply.payloads.generator",
                "the fleet's generator layout",
                sorted(set(gen.tensors) ^ set(self.generator.tensors))[:5],
            )

    def mean_uploads(self, step: Step, replies: list[tuple[AgentInfo, Reply]]) -> dict[str, float]:
        """Per-class plain means of the prototypes and the plain mean of the SDs."""
        protos = [self.payload(r, "protos", PrototypeSet) for _, r in replies]
        sds = [s.sd for s in protos if s.sd is not None]
        sd = self._mean_sd(sds)
        if sd is None and self.protos is not None:
            sd = self.protos.sd
        self.protos = mean_prototypes(
            self.protos,
            protos,
            self.num_classes,
            self.config.proto_encoding,
            sd=sd,
            rule=self.robust,
        )
        if self.config.generator_exchange == "every_round":
            self._average_generators(replies, require_trained=False)
        held = 0 if self.protos is None else self.protos.class_ids.size
        return {
            "classes_with_prototype": float(held),
            "sigma_mean": float(sd.mean()) if sd is not None else 1.0,
        }

    def _mean_sd(self, sds: list[np.ndarray]) -> np.ndarray | None:
        if not sds:
            return None
        if self.robust.plain:
            return np.mean(np.stack(sds), axis=0).astype(np.float32)  # type: ignore[no-any-return]
        return reduce_rows(np.stack(sds), self.robust).astype(np.float32)

    def aggregate_generators(
        self, step: Step, replies: list[tuple[AgentInfo, Reply]]
    ) -> dict[str, float]:
        """The one-shot generator mean (spec M3) over the uploads that trained."""
        return {"generators_averaged": float(self._average_generators(replies, True))}

    def _average_generators(
        self, replies: list[tuple[AgentInfo, Reply]], require_trained: bool
    ) -> int:
        # D10: average only generators that were trained at least once
        maps = [
            self.payload(r, "generator", TensorMap)
            for _, r in replies
            if not require_trained or r.metrics.get("generator_trained", 1.0) > 0
        ]
        if maps:
            # D11: plain mean incl. BN running stats; counters such as num_batches_tracked: max
            self.generator = self.average(maps, None, self.config.generator_encoding, "generators")
        return len(maps)

    def state_dict(self) -> dict[str, Payload]:
        """Global prototypes (with sigma) and the averaged generator."""
        out: dict[str, Payload] = {}
        if self.protos is not None:
            out["protos"] = self.protos
        if self.generator is not None:
            out["generator"] = self.generator
        return out

    def load_state_dict(self, state: dict[str, Payload]) -> None:
        """Restore :meth:`state_dict`."""
        p, g = state.get("protos"), state.get("generator")
        self.protos = p if isinstance(p, PrototypeSet) else None
        self.generator = g if isinstance(g, TensorMap) else None
