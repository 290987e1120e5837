"""Server halves of the baselines: local-only, FedAvg and FedProto."""

from __future__ import annotations

import itertools

import numpy as np

from coordinator.aggregation import MEAN, RobustRule, reduce_by_class, weighted_mean
from coordinator.strategies.base import AgentInfo, Step, Strategy, register_strategy
from protocol.algorithms.baselines import FedAvgConfig, FedProtoConfig, LocalConfig
from protocol.errors import AdmissionError, AggregationError, ValidationError
from protocol.messages import Register, Reply
from protocol.payloads import Payload, PrototypeSet, TensorMap

__all__ = ["FedAvgStrategy", "FedProtoStrategy", "LocalStrategy", "mean_prototypes"]


@register_strategy("local")
class LocalStrategy(Strategy[LocalConfig]):
    """Agents train alone; the coordinator only schedules and records."""


@register_strategy("fedavg")
class FedAvgStrategy(Strategy[FedAvgConfig]):
    """Sample-weighted average of full weights; requires one architecture across the fleet."""

    one_architecture = True

    def __init__(self, config: FedAvgConfig, *, num_classes: int, seed: int = 0) -> None:
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

    def configure(self, step: Step, agent: AgentInfo) -> dict[str, Payload]:
        """The current global weights (none before the first aggregation)."""
        return {} if self.weights is None else {"weights": self.weights}

    def validate(self, step: Step, agent: AgentInfo, reply: Reply) -> None:
        """Weights must be present and, once a global model exists, match its tensors (the
        engine bounded them by ``max_abs_weight`` already)."""
        if step.phase != "train":
            return
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

    def aggregate(self, step: Step, replies: list[tuple[AgentInfo, Reply]]) -> dict[str, float]:
        """Weights averaged by sample count (integer buffers: the maximum), or combined by the
        configured robust rule."""
        if step.phase != "train":
            return {}
        maps = [w for _, r in replies if isinstance(w := r.payloads["weights"], TensorMap)]
        n = [max(r.num_samples, 1) for _, r in replies]
        if self.robust.plain:  # FedAvg's own rule, bit for bit
            self.weights = weighted_mean(maps, n, self.config.weight_encoding, "fedavg weights")
        else:
            self.weights = self.average(maps, n, self.config.weight_encoding, "fedavg weights")
        return {"aggregated": float(len(replies))}

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


def mean_prototypes(
    current: PrototypeSet | None,
    sets: list[PrototypeSet],
    num_classes: int,
    encoding: str = "raw",
    *,
    sd: np.ndarray | None = None,
    rule: RobustRule = MEAN,
) -> PrototypeSet | None:
    """Per-class plain mean over the sets holding the class (or ``rule``'s robust reduction
    over them); classes held by none keep their previous value (FedProto's and FedVTC's
    rule)."""
    dims = {s.dim for s in sets if s.class_ids.size}
    if not dims:
        return current
    if len(dims) > 1 or (
        current is not None and current.class_ids.size and current.dim not in dims
    ):
        raise AggregationError(f"prototype dimensions differ across replies: {sorted(dims)}")
    dim = dims.pop()
    held = [s for s in sets if s.class_ids.size]  # an empty set's vectors may be 0 x anything
    class_ids = np.concatenate([s.class_ids for s in held]).astype(np.int64, copy=False)
    vectors = np.concatenate([s.vectors for s in held])
    hits = np.bincount(class_ids, minlength=num_classes)
    counts = np.bincount(
        class_ids, weights=np.concatenate([s.counts for s in held]), minlength=num_classes
    ).astype(np.int64)  # exact: sample counts are far below 2**53
    # One reduction per class over its rows in reply order: a reduction along axis 0 adds row
    # after row, as `table[ids] += vectors` set after set did, so the sums are the same to the
    # bit (tested), 4-12x faster at 10,000 replies; the transient copy is the size of the
    # replies' prototypes (~60 MB at 10,000 replies of 3 x 512 floats).
    table = np.zeros((num_classes, dim), np.float64)
    new = hits > 0
    if rule.plain:
        order = np.argsort(class_ids, kind="stable")
        sorted_ids = class_ids[order]
        bounds = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1], True])
        for a, b in itertools.pairwise(bounds.tolist()):
            table[sorted_ids[a]] = np.add.reduce(vectors[order[a:b]], axis=0, dtype=np.float64)
        table[new] /= hits[new, None]
    else:
        ids, robust = reduce_by_class(class_ids, vectors, rule)
        table[ids] = robust
    if current is not None:
        for i, c in enumerate(current.class_ids):
            if not new[c]:
                table[c], new[c], counts[c] = current.vectors[i], True, current.counts[i]
    ids = np.nonzero(new)[0]
    return PrototypeSet(ids, table[ids].astype(np.float32), counts[ids], sd=sd, encoding=encoding)  # type: ignore[arg-type]


@register_strategy("fedproto")
class FedProtoStrategy(Strategy[FedProtoConfig]):
    """Per-class plain mean of the participants' prototypes."""

    def __init__(self, config: FedProtoConfig, *, num_classes: int, seed: int = 0) -> None:
        super().__init__(config, num_classes=num_classes, seed=seed)
        self.protos: PrototypeSet | None = None

    def configure(self, step: Step, agent: AgentInfo) -> dict[str, Payload]:
        """Global prototypes (all known classes: FedProto also uses them at inference)."""
        return {} if self.protos is None else {"protos": self.protos}

    def validate(self, step: Step, agent: AgentInfo, reply: Reply) -> None:
        """Prototypes of the agent's own classes, within ``max_abs_feature``, with the fleet's
        feature dimension (round 1: the step's first valid reply's)."""
        if step.phase == "train":
            dim = self.expected_dim(step, "protos", self.protos, self.config.feature_dim)
            protos = self.check_prototypes(agent, reply, "protos", dim)
            self.pin_dim(step, "protos", protos)

    def aggregate(self, step: Step, replies: list[tuple[AgentInfo, Reply]]) -> dict[str, float]:
        """c^y <- mean of c_k^y over participants holding y (unweighted, as in FedProto), or
        the configured robust reduction over them."""
        if step.phase != "train":
            return {}
        sets = [r.payloads["protos"] for _, r in replies]
        self.protos = mean_prototypes(
            self.protos,
            [s for s in sets if isinstance(s, PrototypeSet)],
            self.num_classes,
            self.config.proto_encoding,
            rule=self.robust,
        )
        return {
            "classes_with_prototype": float(
                0 if self.protos is None else self.protos.class_ids.size
            )
        }

    def state_dict(self) -> dict[str, Payload]:
        """The global prototypes."""
        return {} if self.protos is None else {"protos": self.protos}

    def load_state_dict(self, state: dict[str, Payload]) -> None:
        """Restore the global prototypes."""
        p = state.get("protos")
        self.protos = p if isinstance(p, PrototypeSet) else None
