"""LG-FedAvg, server half: the sample-weighted mean of the agents' heads.

The coordinator keeps one global head, sends it to every selected agent (and in ``final``) and
replaces it by the sample-weighted mean of the uploaded heads through FedAvg's own code
(:class:`FedAvgStrategy`, :func:`coordinator.aggregation.weighted_mean`). Extractors never
travel, so agents of any architecture may join; the head alone must agree: its tensors are
checked against the global head, and in round 1 against the round's first valid upload.
"""

from __future__ import annotations

from typing import Any

from coordinator.strategies.base import AgentInfo, Step, register_strategy
from coordinator.strategies.baselines import FedAvgStrategy
from protocol.algorithms.lg_fedavg import LGFedAvgConfig
from protocol.contract.messages import Reply
from protocol.contract.payloads import TensorMap
from protocol.errors import ValidationError

__all__ = ["LGFedAvgStrategy", "SharedModuleStrategy", "tensor_layout"]


def tensor_layout(tensors: TensorMap) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape: what two uploads must share to be averaged."""
    return {k: tuple(v.shape) for k, v in tensors.tensors.items()}


class SharedModuleStrategy(FedAvgStrategy):
    """FedAvg of one module every agent holds in one shape (LG-FedAvg's head, FML's and FedKD's
    shared model), whatever the rest of each agent's model is."""

    one_architecture = False  # only the shared module must agree

    def __init__(self, config: Any, *, num_classes: int, seed: int = 0) -> None:
        super().__init__(config, num_classes=num_classes, seed=seed)
        # before the first aggregation, uploads must agree with the step's first valid one
        self._first: tuple[Step, dict[str, tuple[int, ...]]] | None = None

    def admit(self, agent: AgentInfo, fleet: list[AgentInfo]) -> None:
        """Any architecture (FedAvg's one-architecture rule does not apply)."""

    def validate(self, step: Step, agent: AgentInfo, reply: Reply) -> None:
        """The module's tensors: those of the global module, or before the first aggregation
        those of the step's first valid upload."""
        super().validate(step, agent, reply)  # matches the global module once there is one
        if step.phase != "train" or self.weights is not None:
            return
        layout = tensor_layout(self.payload(reply, "weights", TensorMap))
        if self._first is None or self._first[0] != step:
            self._first = (step, layout)
            return
        if layout != self._first[1]:
            diff = sorted(set(layout.items()) ^ set(self._first[1].items()))[:4]
            raise ValidationError(
                "reply.payloads.weights",
                f"the tensors of this round's first upload {self._first[1]}",
                f"{agent.device_id}: differs in {diff}",
            )


@register_strategy("lg_fedavg")
class LGFedAvgStrategy(SharedModuleStrategy):
    """One global head, averaged by sample count; extractors stay home.

    Any architecture and input may join: only the head is shared, and its classes were checked
    by the engine. Its feature dimension is not in the registration, so :meth:`validate` refuses
    a head of another shape at its first upload.
    """

    config: LGFedAvgConfig
