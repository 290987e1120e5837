"""Server halves that average model weights: the sample-weighted (or uniform) mean of the
uploaded ``weights`` (FedAvg, CCVR, FedType) and of one module every agent holds in one shape
(LG-FedAvg's head, FML's and FedKD's shared model)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

from coordinator.aggregation import weighted_mean
from coordinator.strategies.base import (
    AgentInfo,
    PhaseHooks,
    Step,
    Strategy,
    admit_one_input,
)
from protocol.algorithms.fml import CLIENT0_ARCH
from protocol.contract.messages import Register, Reply
from protocol.contract.payloads import Payload, TensorMap
from protocol.errors import AdmissionError, ValidationError

__all__ = [
    "SharedModelStrategy",
    "SharedModuleStrategy",
    "WeightAveragingStrategy",
    "tensor_layout",
]


class WeightAveragingStrategy(Strategy[Any]):
    """Sample-weighted average of full weights; requires one architecture across the fleet."""

    one_architecture = True
    admission_rules = True
    stale_replies = "weighted"  # sample count x staleness weight

    def __init__(self, config: Any, *, num_classes: int, seed: int = 0) -> None:
        super().__init__(config, num_classes=num_classes, seed=seed)
        self.weights: TensorMap | None = None

    def admit(self, agent: AgentInfo, fleet: list[AgentInfo]) -> None:
        """One architecture and input for the whole fleet: FedAvg averages full weights."""
        others = [a.register for a in fleet if a.device_id != agent.device_id]
        reg = agent.register
        if others and (reg.arch, reg.input_spec, reg.num_params) != (
            others[0].arch,
            others[0].input_spec,
            others[0].num_params,
        ):
            ref = others[0]
            raise AdmissionError(
                agent.device_id,
                f"{self.name} averages one architecture; the fleet runs {ref.arch} "
                f"({ref.num_params} params, input {_shape(ref)}), this agent {reg.arch} "
                f"({reg.num_params} params, input {_shape(reg)})",
            )

    def phase_hooks(self) -> dict[str, PhaseHooks]:
        """Training rounds exchange and average the weights; ``final`` sends the last ones."""
        return {
            "train": PhaseHooks(self.send_weights, self.check_weights, self.average_weights),
            "final": PhaseHooks(configure=self.send_weights),
        }

    def send_weights(self, step: Step, agent: AgentInfo) -> dict[str, Payload]:
        """The current global weights (none before the first aggregation)."""
        return {} if self.weights is None else {"weights": self.weights}

    def check_weights(self, step: Step, agent: AgentInfo, reply: Reply) -> None:
        """Weights must be present and, once a global model exists, match its tensors (the
        engine bounded them by ``max_abs_weight`` already)."""
        w = reply.payloads.get("weights")
        if not isinstance(w, TensorMap):
            raise ValidationError(
                "reply.payloads.weights", "tensors", "nothing" if w is None else w.KIND
            )
        if self.weights is not None:
            ref = self.weights.tensors
            bad = [k for k in ref if k not in w.tensors or w.tensors[k].shape != ref[k].shape]
            if bad or len(w.tensors) != len(ref):
                raise ValidationError(
                    "reply.payloads.weights",
                    "the global model's tensors",
                    f"mismatch in {bad[:5] or 'tensor names'}",
                )

    def average_weights(
        self, step: Step, replies: list[tuple[AgentInfo, Reply]]
    ) -> dict[str, float]:
        """Weights averaged by sample count, or uniformly with ``sample_weighted = false``
        (integer buffers: the maximum), or combined by the configured robust rule."""
        replies, outliers = self.agreeing(replies)
        maps = [w for _, r in replies if isinstance(w := r.payloads["weights"], TensorMap)]
        by_samples = self.config.sample_weighted
        n = [
            (max(r.num_samples, 1) if by_samples else 1) * self.reply_weight(r) for _, r in replies
        ]
        if self.robust.plain:  # FedAvg's own rule, bit for bit
            self.weights = weighted_mean(maps, n, self.config.weight_encoding, "fedavg weights")
        else:
            self.weights = self.average(maps, n, self.config.weight_encoding, "fedavg weights")
        return {"aggregated": float(len(replies)), **outliers}

    def agreeing(
        self, replies: list[tuple[AgentInfo, Reply]]
    ) -> tuple[list[tuple[AgentInfo, Reply]], dict[str, float]]:
        """The replies to average, and ``layout_outliers`` when some are left out.

        Once a global module exists, validation held every upload to its tensors. Before it
        (round 1), the uploads whose tensor layout most of them share are averaged and the
        others left out: no single upload, a forged one among them, can fix the layout every
        other upload must have (ties go to the layout that sorts first, the same in every
        process)."""
        if self.weights is not None or not replies:
            return replies, {}
        keys = [_layout_key(r.payloads.get("weights")) for _, r in replies]
        counts = Counter(keys)
        best = min(counts, key=lambda k: (-counts[k], k))
        kept = [pair for pair, k in zip(replies, keys, strict=True) if k == best]
        left = len(replies) - len(kept)
        return kept, ({"layout_outliers": float(left)} if left else {})

    def state_dict(self) -> dict[str, Payload]:
        """The global weights."""
        return {} if self.weights is None else {"weights": self.weights}

    def load_state_dict(self, state: dict[str, Payload]) -> None:
        """Restore the global weights."""
        w = state.get("weights")
        self.weights = w if isinstance(w, TensorMap) else None


def _shape(reg: Register) -> str:
    spec = reg.input_spec
    return f"{spec.channels}x{spec.height}x{spec.width}"


def tensor_layout(tensors: TensorMap) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape: what two uploads must share to be averaged."""
    return {k: tuple(v.shape) for k, v in tensors.tensors.items()}


def _layout_key(weights: object) -> str:
    """A layout as one comparable string (empty: not weights)."""
    if not isinstance(weights, TensorMap):
        return ""
    return ";".join(f"{k}:{list(s)}" for k, s in sorted(tensor_layout(weights).items()))


class SharedModuleStrategy(WeightAveragingStrategy):
    """FedAvg of one module every agent holds in one shape (LG-FedAvg's head, FML's and FedKD's
    shared model), whatever the rest of each agent's model is."""

    one_architecture = False  # only the shared module must agree

    def admit(self, agent: AgentInfo, fleet: list[AgentInfo]) -> None:
        """Any architecture (FedAvg's one-architecture rule does not apply)."""


class SharedModelStrategy(SharedModuleStrategy):
    """A shared model built by every agent from the config's ``shared_model`` (FML's meme,
    FedKD's mentee): private architectures may differ, the input they feed it may not."""

    def __init__(self, config: Any, *, num_classes: int, seed: int = 0) -> None:
        super().__init__(config, num_classes=num_classes, seed=seed)
        self._archs: dict[str, str] = {}  # device id -> registered architecture

    def admit(self, agent: AgentInfo, fleet: list[AgentInfo]) -> None:
        """Any private architecture; one input spec, since every agent builds the same model."""
        admit_one_input(agent, fleet, self.config.shared_model)
        self._archs[agent.device_id] = agent.register.arch

    def observe_fleet(self, agents: Iterable[AgentInfo]) -> None:
        """When a step opens, before its tasks take the config (a resumed step's too: a
        restarted coordinator admits no one before it): ``shared_model = client0_arch``
        becomes the architecture of the first agent by device id (``agent2`` before
        ``agent10``) among those admitted and the step's participants, the one HtFLlib's
        client 0 would be."""
        agents = list(agents)
        super().observe_fleet(agents)
        for agent in agents:
            self._archs.setdefault(agent.device_id, agent.register.arch)
        if self.config.shared_model == CLIENT0_ARCH and self._archs:
            first = min(self._archs, key=_device_order)
            self.config = self.config.replace(shared_model=self._archs[first])


def _device_order(device_id: str) -> list[tuple[int, str]]:
    # numbers by value, so that agent2 comes before agent10
    return [(int(p), "") if p.isdigit() else (-1, p) for p in re.split(r"(\d+)", device_id)]
