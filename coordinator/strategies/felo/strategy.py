"""Felo, Velo and FedHe, server half (``shared/specs/felo_velo.md`` §2.2).

Each round: every participant uploads class-wise mean features and logits (``knowledge``) and,
with same-architecture averaging on, its whole model (``weights``). The coordinator keeps the
entries in a :class:`KnowledgeTable` under the configured window, averages the weights within
each architecture group (sample-weighted, BN buffers included) and never across groups. The next
round's task carries the table's per-class means (Velo: a CVAE sample per class instead of the
mean feature) once warm-up is over, and the group model of the agent's architecture.

In a buffered run each entry is dated by the round of the task it answers and weighs its
reply's staleness weight in the table's means; a group model weighs each upload by its sample
count times that weight.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from coordinator.aggregation import RobustRule, reduce_by_class
from coordinator.strategies.base import (
    AgentInfo,
    PhaseHooks,
    ServerContext,
    Step,
    Strategy,
    register_strategy,
)
from coordinator.strategies.felo.table import KnowledgeTable
from protocol.algorithms.felo import FedHeConfig, FeloConfig, VeloConfig
from protocol.contract.messages import Reply
from protocol.contract.payloads import (
    FeatureLogitSet,
    LabelledVectors,
    Payload,
    PrototypeSet,
    TensorMap,
)
from protocol.errors import AggregationError, ValidationError

__all__ = ["FedHeStrategy", "FeloStrategy", "VeloStrategy", "group_key"]

GROUP_PREFIX = "group:"


def group_key(agent: AgentInfo) -> str:
    """Architecture group of an agent: its registered architecture and input spec."""
    spec = agent.register.input_spec
    return f"{agent.register.arch}@{spec.channels}x{spec.height}x{spec.width}"


class _FeatureLogitStrategy(Strategy[Any]):
    """Knowledge table + per-architecture weight groups; Velo adds the CVAE."""

    stale_replies = "weighted"  # entries dated by their task's round, staleness-weighted
    needs_class_counts = True  # each entry's count is bounded by the class's registered samples

    def __init__(self, config: Any, *, num_classes: int, seed: int = 0) -> None:
        super().__init__(config, num_classes=num_classes, seed=seed)
        self.table = KnowledgeTable(
            num_classes,
            config.knowledge_window,
            config.history_cap,
            config.count_weighted,
            config.window_rounds,
        )
        self.groups: dict[str, TensorMap] = {}
        self.warmup = config.warmup_rounds(1)

    def plan(self, rounds: int) -> list[Step]:
        """Training rounds then ``final``; fixes the warm-up length from the round count."""
        self.warmup = self.config.warmup_rounds(rounds)
        return super().plan(rounds)

    def phase_hooks(self) -> dict[str, PhaseHooks]:
        """Training rounds exchange knowledge (and group models); ``final`` sends the group
        model."""
        return {
            "train": PhaseHooks(
                self.send_knowledge, self.check_upload, self.fold_uploads, self.train_server
            ),
            "final": PhaseHooks(configure=self.send_group_model),
        }

    def train_server(self, step: Step, ctx: ServerContext) -> dict[str, float]:
        """Server training after a round (Felo, FedHe: none)."""
        return {}

    # ----- what each agent receives ---------------------------------------------------------
    def send_group_model(self, step: Step, agent: AgentInfo) -> dict[str, Payload]:
        """Group weights when the group has some."""
        weights = self.groups.get(group_key(agent)) if self.config.same_arch_avg else None
        return {} if weights is None else {"weights": weights}

    def send_knowledge(self, step: Step, agent: AgentInfo) -> dict[str, Payload]:
        """Group weights when the group has some; knowledge once warm-up is over."""
        out = self.send_group_model(step, agent)
        if step.round > self.warmup:
            knowledge = self.server_knowledge()
            if knowledge is not None:
                out["knowledge"] = knowledge
        return out

    def server_knowledge(self) -> FeatureLogitSet | None:
        """Per-class table means (Felo, FedHe), or the configured robust reduction over each
        class's entries."""
        if self.robust.plain:
            return self.table.means(self.config.knowledge_encoding)
        return robust_means(self.table, self.robust, self.config.knowledge_encoding)

    # ----- what each agent sends ------------------------------------------------------------
    def check_upload(self, step: Step, agent: AgentInfo, reply: Reply) -> None:
        """Knowledge of the agent's own classes with the federation's sizes; weights matching
        the group model when averaging is on."""
        k = reply.payloads.get("knowledge")
        if not isinstance(k, FeatureLogitSet):
            got = "nothing" if k is None else type(k).KIND
            raise ValidationError("reply.payloads.knowledge", "featlogits", got)
        self._check_knowledge(step, agent, k)
        if self.config.same_arch_avg:
            self._check_weights(agent, reply.payloads.get("weights"))

    def _check_knowledge(self, step: Step, agent: AgentInfo, k: FeatureLogitSet) -> None:
        where = "reply.payloads.knowledge"
        ids = k.class_ids.tolist()
        unknown = sorted(set(ids) - set(agent.classes))
        if unknown:
            raise ValidationError(
                f"{where}.class_ids", f"classes registered {agent.classes}", unknown
            )
        if k.class_ids.size and k.logits.shape[1] != self.num_classes:
            raise ValidationError(
                f"{where}.logits", f"{self.num_classes} columns", k.logits.shape[1]
            )
        # declared, or the table's, or before any entry the fleet's registered size: a reply
        # of another dimension is refused here, not in the table (which would fail the step)
        dim = self.expected_dim(self.table.feature_dim, self.config.feature_dim)
        if dim is not None and k.class_ids.size and k.features.shape[1] != dim:
            raise ValidationError(f"{where}.features", f"dimension {dim}", k.features.shape[1])
        held = agent.register.counts_by_class()
        limit = max(1, self.config.local_epochs)
        over = [
            c
            for c, n in zip(ids, k.counts.tolist(), strict=True)
            if n < 1 or n > limit * held.get(c, 0)
        ]
        if over:
            raise ValidationError(
                f"{where}.counts", "1..local_epochs x the registered samples of each class", over
            )

    def _check_weights(self, agent: AgentInfo, w: Payload | None) -> None:
        if not isinstance(w, TensorMap):
            got = "nothing" if w is None else type(w).KIND
            raise ValidationError("reply.payloads.weights", "tensors", got)
        ref = self.groups.get(group_key(agent))
        if ref is None:
            return
        bad = sorted(
            n
            for n in set(ref.tensors) | set(w.tensors)
            if n not in w.tensors
            or n not in ref.tensors
            or w.tensors[n].shape != ref.tensors[n].shape
        )
        if bad:
            raise ValidationError(
                "reply.payloads.weights", f"the tensors of group {group_key(agent)}", bad[:5]
            )

    # ----- the round's aggregation ----------------------------------------------------------
    def fold_uploads(self, step: Step, replies: list[tuple[AgentInfo, Reply]]) -> dict[str, float]:
        """Add the uploads to the table; FedAvg within each architecture group."""
        uploads = [
            (a, r, k)
            for a, r in replies
            if isinstance(k := r.payloads.get("knowledge"), FeatureLogitSet)
        ]
        self.table.add(
            step.round,
            [(a.device_id, k) for a, _, k in uploads],
            dated=[r.round for _, r, _ in uploads],
            weights=[self.reply_weight(r) for _, r, _ in uploads],
        )
        metrics = {
            "knowledge_entries": float(len(self.table)),
            "knowledge_classes": float(np.unique(self.table.cls).size),
        }
        if self.config.same_arch_avg:
            metrics.update(self._average_groups(replies))
        return metrics

    def _average_groups(self, replies: list[tuple[AgentInfo, Reply]]) -> dict[str, float]:
        members: dict[str, list[tuple[TensorMap, float]]] = {}
        for agent, reply in replies:
            w = reply.payloads.get("weights")
            if isinstance(w, TensorMap):
                n = max(reply.num_samples, 1) * self.reply_weight(reply)
                members.setdefault(group_key(agent), []).append((w, n))
        failed = 0
        for key, group in sorted(members.items()):
            try:
                self.groups[key] = self.average(
                    [w for w, _ in group],
                    [n for _, n in group],
                    self.config.weight_encoding,
                    what=f"group {key}",
                )
            except AggregationError:
                # two first uploads of a new group disagree on their tensors: keep the group
                # unaveraged this round rather than failing the whole step
                failed += 1
        return {"groups_averaged": float(len(members) - failed), "groups_failed": float(failed)}

    # ----- durable state --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Payload]:
        """The knowledge entries and every group model."""
        out: dict[str, Payload] = {"knowledge": self.table.to_tensormap()}
        out.update({GROUP_PREFIX + k: v for k, v in self.groups.items()})
        return out

    def load_state_dict(self, state: dict[str, Payload]) -> None:
        """Restore the entries and the group models."""
        k = state.get("knowledge")
        if isinstance(k, TensorMap):
            self.table.load_tensormap(k)
        self.groups = {
            name.removeprefix(GROUP_PREFIX): v
            for name, v in state.items()
            if name.startswith(GROUP_PREFIX) and isinstance(v, TensorMap)
        }


def robust_means(
    table: KnowledgeTable, rule: RobustRule, encoding: Literal["raw", "f16"]
) -> FeatureLogitSet | None:
    """:meth:`KnowledgeTable.means` under ``rule``: per class, features and logits each reduced
    over the kept entries of that class (weighted as the table weighs them), counts summed.
    Velo's CVAE still trains on every entry."""
    if not len(table):
        return None
    weights = table.entry_weights()
    ids, feats = reduce_by_class(table.cls, table.features, rule, weights)
    _, logits = reduce_by_class(table.cls, table.logits, rule, weights)
    counts = np.array([table.counts[table.cls == c].sum() for c in ids.tolist()], np.int64)
    counts = np.minimum(counts, np.iinfo(np.int32).max)
    return FeatureLogitSet(
        ids.astype(np.int32),
        feats.astype(np.float32),
        logits.astype(np.float32),
        counts.astype(np.int32),
        encoding=encoding,
    )


@register_strategy("felo")
class FeloStrategy(_FeatureLogitStrategy):
    """Felo: table means of features and logits, same-architecture averaging."""

    config: FeloConfig


@register_strategy("fedhe")
class FedHeStrategy(_FeatureLogitStrategy):
    """FedHe: the same table, logits only, no weight averaging (set by its config)."""

    config: FedHeConfig


@register_strategy("velo")
class VeloStrategy(_FeatureLogitStrategy):
    """Velo: a CVAE trained on the table's features supplies one feature per class."""

    config: VeloConfig

    def __init__(self, config: VeloConfig, *, num_classes: int, seed: int = 0) -> None:
        super().__init__(config, num_classes=num_classes, seed=seed)
        self.cvae: TensorMap | None = None  # the CVAE's state dict (torch stays lazy)
        self.synthetic: PrototypeSet | None = None  # this round's sample per class
        # the uploaded individual features (upload_samples > 0), under the table's window
        self.samples = KnowledgeTable(
            num_classes,
            config.knowledge_window,
            config.history_cap,
            rounds=config.window_rounds,
        )

    def check_upload(self, step: Step, agent: AgentInfo, reply: Reply) -> None:
        """Felo's checks, and a sample of individual features only when the run asks for one:
        of the agent's own classes, at most ``upload_samples`` a class, of the knowledge's
        feature size."""
        super().check_upload(step, agent, reply)
        s = reply.payloads.get("samples")
        if s is None:
            return
        where = "reply.payloads.samples"
        if not isinstance(s, LabelledVectors) or self.config.upload_samples <= 0:
            raise ValidationError(where, "none (upload_samples = 0)", type(s).KIND)
        labels = s.labels.tolist()
        unknown = sorted(set(labels) - set(agent.classes))
        if unknown:
            raise ValidationError(f"{where}.labels", f"classes registered {agent.classes}", unknown)
        per_class = np.bincount(s.labels, minlength=self.num_classes)
        if per_class.max(initial=0) > self.config.upload_samples:
            got = int(per_class.max())
            raise ValidationError(
                f"{where}.labels", f"<= {self.config.upload_samples} a class", got
            )
        k = reply.payloads["knowledge"]
        assert isinstance(k, FeatureLogitSet)  # super() checked it
        if s.labels.size and k.class_ids.size and s.vectors.shape[1] != k.features.shape[1]:
            dim = k.features.shape[1]
            raise ValidationError(f"{where}.vectors", f"dimension {dim}", s.vectors.shape[1])

    def fold_uploads(self, step: Step, replies: list[tuple[AgentInfo, Reply]]) -> dict[str, float]:
        """Felo's, and the individual features into their own table (dated and weighted as
        the knowledge entries)."""
        metrics = super().fold_uploads(step, replies)
        uploads = [
            (a, r, s)
            for a, r in replies
            if isinstance(s := r.payloads.get("samples"), LabelledVectors)
        ]
        if uploads or len(self.samples):
            self.samples.add_samples(
                step.round,
                [(a.device_id, s) for a, _, s in uploads],
                dated=[r.round for _, r, _ in uploads],
                weights=[self.reply_weight(r) for _, r, _ in uploads],
            )
            metrics["sample_entries"] = float(len(self.samples))
        return metrics

    def server_knowledge(self) -> FeatureLogitSet | None:
        """Table logits with the CVAE's features; classes without a sample keep the mean
        (§8-D14)."""
        means = super().server_knowledge()
        if means is None or self.synthetic is None:
            return means
        feats = means.features.copy()
        sample = self.synthetic.as_dict()
        for i, c in enumerate(means.class_ids.tolist()):
            if c in sample and sample[c].shape == feats[i].shape:
                feats[i] = sample[c]
        return FeatureLogitSet(
            means.class_ids, feats, means.logits, means.counts, encoding=means.encoding
        )

    def train_server(self, step: Step, ctx: ServerContext) -> dict[str, float]:
        """Every ``cvae_interval`` rounds from the last warm-up round on: continue training the
        CVAE on the kept features, then draw one feature per class for the next round."""
        due = step.round >= self.warmup
        if not due or (step.round - self.warmup) % self.config.cvae_interval or not len(self.table):
            return {}
        from coordinator.strategies.felo.cvae import (
            train_and_sample,  # torch only on the server's path
        )
        from models.fit import FitError

        try:
            # individual features when the agents send them, else the class means
            source = self.samples if len(self.samples) else self.table
            self.cvae, self.synthetic, metrics = train_and_sample(
                self.cvae, source, self.config, ctx
            )
        except FitError as exc:  # the engine closes the step failed and keeps the last state
            raise AggregationError(f"velo: CVAE training failed: {exc}") from exc
        return metrics

    def state_dict(self) -> dict[str, Payload]:
        """Felo's state, the CVAE weights and the current samples."""
        out = super().state_dict()
        if len(self.samples):
            out["samples"] = self.samples.to_tensormap()
        if self.cvae is not None:
            out["cvae"] = self.cvae
        if self.synthetic is not None:
            out["synthetic"] = self.synthetic
        return out

    def load_state_dict(self, state: dict[str, Payload]) -> None:
        """Restore Felo's state, the CVAE and the samples."""
        super().load_state_dict(state)
        samples = state.get("samples")
        if isinstance(samples, TensorMap):
            self.samples.load_tensormap(samples)
        cvae, synthetic = state.get("cvae"), state.get("synthetic")
        self.cvae = cvae if isinstance(cvae, TensorMap) else None
        self.synthetic = synthetic if isinstance(synthetic, PrototypeSet) else None
