"""FedGen, server half: agents' heads teach a label-conditional feature generator.

``aggregate`` keeps the round's heads (and, with ``head_exchange``, averages them by sample
count); ``server_train`` continues training the generator against their sample-weighted
ensemble (``coordinator/strategies/fedgen/server.py``); ``configure`` sends the generator, the
fleet's label
counts (the edge samples labels from them) and the mean head. The label counts are the sum of
the class counts every agent seen so far registered (HtFLlib's ``qualified_labels``). In a
buffered run a head's weight, in the mean head and in the ensemble, is its sample count times
its reply's staleness weight.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from coordinator.strategies.base import (
    AgentInfo,
    PhaseHooks,
    ServerContext,
    Step,
    Strategy,
    register_strategy,
)
from protocol.algorithms.fedgen import FedGenConfig
from protocol.contract.messages import Reply
from protocol.contract.payloads import Payload, TensorMap
from protocol.errors import AggregationError, ValidationError

__all__ = ["FedGenStrategy"]


@register_strategy("fedgen")
class FedGenStrategy(Strategy[FedGenConfig]):
    """The server half of FedGen."""

    stale_replies = "weighted"  # sample count x staleness weight, mean head and ensemble
    needs_class_counts = True  # the generator is trained on the fleet's label distribution

    def __init__(self, config: FedGenConfig, *, num_classes: int, seed: int = 0) -> None:
        super().__init__(config, num_classes=num_classes, seed=seed)
        self.generator: TensorMap | None = None
        self.head: TensorMap | None = None  # sample-weighted mean head (head_exchange)
        self.fleet_counts: dict[str, npt.NDArray[np.int64]] = {}  # device -> class counts
        self._pending: tuple[list[TensorMap], list[float]] | None = None
        self._dim: int | None = None  # the federation's feature dimension, once known

    def label_counts(self) -> npt.NDArray[np.int64]:
        """Samples per class over every agent seen so far."""
        total = np.zeros(self.num_classes, np.int64)
        for counts in self.fleet_counts.values():
            total += counts
        return total

    def _see(self, agent: AgentInfo) -> None:
        counts = np.zeros(self.num_classes, np.int64)
        for c, n in agent.register.counts_by_class().items():
            if 0 <= int(c) < self.num_classes:
                counts[int(c)] = n
        self.fleet_counts[agent.device_id] = counts

    def phase_hooks(self) -> dict[str, PhaseHooks]:
        """Training rounds: heads up, the generator trained on them down; ``final``: the
        generator and the mean head."""
        return {
            "train": PhaseHooks(
                self.send_generator, self.check_head, self.keep_heads, self.fit_generator
            ),
            "final": PhaseHooks(configure=self.send_generator),
        }

    def send_generator(self, step: Step, agent: AgentInfo) -> dict[str, Payload]:
        """The generator with the label counts, and the mean head (after the first round)."""
        self._see(agent)
        out: dict[str, Payload] = {}
        if self.generator is not None:
            out["generator"] = self.generator
            out["labels"] = TensorMap({"counts": self.label_counts()})
        if self.config.head_exchange and self.head is not None:
            out["weights"] = self.head
        return out

    def check_head(self, step: Step, agent: AgentInfo, reply: Reply) -> None:
        """A linear head ``weight [C, D]``, ``bias [C]`` with the federation's ``D``."""
        head = self.payload(reply, "weights", TensorMap)
        if set(head.tensors) != {"weight", "bias"}:
            raise ValidationError(
                "reply.payloads.weights", "a linear head {weight, bias}", sorted(head.tensors)
            )
        w, b = head.tensors["weight"], head.tensors["bias"]
        c = self.num_classes
        if w.ndim != 2 or w.shape[0] != c or (self._dim is not None and w.shape[1] != self._dim):
            want = f"[{c}, {self._dim if self._dim is not None else 'D'}]"
            raise ValidationError("reply.payloads.weights.weight", f"shape {want}", list(w.shape))
        if b.shape != (c,):
            raise ValidationError("reply.payloads.weights.bias", f"shape [{c}]", list(b.shape))

    def keep_heads(self, step: Step, replies: list[tuple[AgentInfo, Reply]]) -> dict[str, float]:
        """Keep the heads for :meth:`server_train`; average them by sample count (times each
        reply's staleness weight)."""
        heads = [self.payload(r, "weights", TensorMap) for _, r in replies]
        samples = [max(r.num_samples, 1) * self.reply_weight(r) for _, r in replies]
        for a, _ in replies:
            self._see(a)
        dims = {int(h.tensors["weight"].shape[1]) for h in heads}
        if len(dims) > 1:
            raise AggregationError(
                f"fedgen: head input sizes differ across replies: {sorted(dims)}"
            )
        self._dim = dims.pop() if dims else self._dim
        self._pending = (heads, samples) if heads else None
        if self.config.head_exchange and heads:
            self.head = self.average(heads, samples, self.config.head_encoding, "fedgen heads")
        return {"heads": float(len(heads))}

    def fit_generator(self, step: Step, ctx: ServerContext) -> dict[str, float]:
        """Train the generator against the round's heads."""
        if self._pending is None:
            return {}
        heads, samples = self._pending
        self._pending = None
        from coordinator.strategies.fedgen.server import train_generator  # torch only on this path
        from models.fit import FitError

        try:
            self.generator, metrics = train_generator(
                self.generator, heads, samples, self.label_counts(), cfg=self.config, ctx=ctx
            )
        except FitError as exc:  # the engine closes the step failed and keeps the last state
            raise AggregationError(f"fedgen: generator training failed: {exc}") from exc
        return metrics

    def state_dict(self) -> dict[str, Payload]:
        """Generator, mean head and the fleet's class counts."""
        out: dict[str, Payload] = {}
        if self.generator is not None:
            out["generator"] = self.generator
        if self.head is not None:
            out["head"] = self.head
        if self.fleet_counts:
            out["fleet_counts"] = TensorMap(dict(self.fleet_counts))
        return out

    def load_state_dict(self, state: dict[str, Payload]) -> None:
        """Restore :meth:`state_dict`."""
        g, h, f = state.get("generator"), state.get("head"), state.get("fleet_counts")
        self.generator = g if isinstance(g, TensorMap) else None
        self.head = h if isinstance(h, TensorMap) else None
        self.fleet_counts = (
            {k: v.astype(np.int64) for k, v in f.tensors.items()}
            if isinstance(f, TensorMap)
            else {}
        )
        self._dim = None if self.head is None else int(self.head.tensors["weight"].shape[1])
        if self._dim is None and self.generator is not None:
            self._dim = int(self.generator.tensors["3.weight"].shape[0])
        self._pending = None
