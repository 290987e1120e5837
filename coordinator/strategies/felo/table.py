"""Felo's and Velo's server-side knowledge table: class-wise feature and logit means.

Every uploaded (client, class) mean is one *entry*, dated by the round of the task it answers
(in a buffered run a reply folded rounds after its task was sent is as old as its task, not as
the round that folds it) and carrying that reply's staleness weight (1 when fresh). The window
(spec §8-D3) decides which entries are kept: ``history_fifo`` (the paper's "server dataset" and
the authors' code: every entry, at most ``cap`` per class, oldest dropped first),
``latest_per_client`` (a K x C table of the freshest entries) or ``current_round`` (only the
entries of the last fold); a bound in rounds (``rounds``) drops entries of older tasks under any
of them, so that a count-weighted mean is not dominated by entries from models many rounds old.
The per-class server knowledge is the mean over kept entries, each weighted by its staleness
weight (times its count when ``count_weighted``), and Velo's CVAE trains on the same entries'
features, so Velo - Felo is not confounded by stale data.

Entries are numpy arrays and persist as one :class:`TensorMap` (no pickle); clients are keyed by
a 63-bit hash of their device id, since only equality of clients matters.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from protocol.contract.payloads import FeatureLogitSet, LabelledVectors, TensorMap
from protocol.errors import ValidationError

__all__ = ["KnowledgeTable", "Window", "client_key"]

Window = Literal["history_fifo", "latest_per_client", "current_round"]
_FIELDS = ("cls", "client", "round", "features", "logits", "counts", "weight")


def client_key(device_id: str) -> int:
    """A stable 63-bit integer for a device id (fits the int64 entry column)."""
    return int.from_bytes(hashlib.blake2b(device_id.encode(), digest_size=8).digest(), "big") >> 1


@dataclass
class KnowledgeTable:
    """Entries of class-wise means, pruned to a window; per-class means on demand."""

    num_classes: int
    window: Window = "history_fifo"
    cap: int = 5000
    count_weighted: bool = False
    rounds: int = 0  # > 0: entries of tasks this many rounds old are dropped, whatever the window

    def __post_init__(self) -> None:
        self.cls = np.zeros(0, np.int64)
        self.client = np.zeros(0, np.int64)
        self.round = np.zeros(0, np.int64)
        self.counts = np.zeros(0, np.int64)
        # float32 as persisted, so that a restored table averages exactly as before
        self.weight: npt.NDArray[np.float32] = np.zeros(0, np.float32)
        self.features: npt.NDArray[np.float32] = np.zeros((0, 0), np.float32)
        self.logits: npt.NDArray[np.float32] = np.zeros((0, self.num_classes), np.float32)

    def __len__(self) -> int:
        return int(self.cls.size)

    @property
    def feature_dim(self) -> int | None:
        """The federation's feature size, fixed by the first entry (None before)."""
        return int(self.features.shape[1]) if len(self) else None

    def add(
        self,
        round_: int,
        uploads: Sequence[tuple[str, FeatureLogitSet]],
        *,
        dated: Sequence[int] | None = None,
        weights: Sequence[float] | None = None,
    ) -> None:
        """Append the uploads folded in round ``round_``, then prune to the window. ``dated``:
        the round of the task each upload answers (default ``round_``); ``weights``: each
        upload's staleness weight (default 1)."""
        first = len(self)
        for (device_id, s), task_round, w in zip(
            uploads, _or(dated, round_, uploads), _or(weights, 1.0, uploads), strict=True
        ):
            if s.class_ids.size:
                cols = (s.class_ids, s.features, s.logits, s.counts)
                self._append(task_round, w, device_id, *cols)
        self._prune(round_, first)

    def add_samples(
        self,
        round_: int,
        uploads: Sequence[tuple[str, LabelledVectors]],
        *,
        dated: Sequence[int] | None = None,
        weights: Sequence[float] | None = None,
    ) -> None:
        """Append the individual vectors folded in round ``round_`` (one entry each, count 1, no
        logits; ``dated`` and ``weights`` as in :meth:`add`), then prune to the window: a table
        of samples rather than of means."""
        first = len(self)
        for (device_id, s), task_round, w in zip(
            uploads, _or(dated, round_, uploads), _or(weights, 1.0, uploads), strict=True
        ):
            m = int(s.labels.size)
            if m:
                logits = np.zeros((m, self.num_classes), np.float32)
                self._append(task_round, w, device_id, s.labels, s.vectors, logits, np.ones(m))
        self._prune(round_, first)

    def _append(  # noqa: PLR0917 - one entry's columns
        self,
        round_: int,
        weight: float,
        device_id: str,
        classes: npt.NDArray[np.int32],
        features: npt.NDArray[np.float32],
        logits: npt.NDArray[np.float32],
        counts: npt.NDArray[Any],
    ) -> None:
        m = int(classes.size)
        dim = self.feature_dim
        if dim is not None and features.shape[1] != dim:
            raise ValidationError("knowledge.features", f"dimension {dim}", features.shape[1])
        self.cls = np.concatenate([self.cls, classes.astype(np.int64)])
        self.client = np.concatenate([self.client, np.full(m, client_key(device_id))])
        self.round = np.concatenate([self.round, np.full(m, round_, np.int64)])
        self.weight = np.concatenate([self.weight, np.full(m, weight, np.float32)])
        self.counts = np.concatenate([self.counts, counts.astype(np.int64)])
        feats = features if dim is not None else features.reshape(m, -1)
        self.features = np.concatenate([self.features.reshape(-1, feats.shape[1]), feats])
        self.logits = np.concatenate([self.logits, logits])

    def _prune(self, round_: int, first: int) -> None:
        """Keep the window's entries as of round ``round_``; ``first``: the first entry of
        the fold just appended."""
        n = len(self)
        # oldest first by task round, then by arrival (a stale reply is as old as its task)
        order = np.lexsort((np.arange(n), self.round))
        if self.window == "current_round":  # the last fold's entries, stale ones weighted
            keep = np.arange(n) >= first
        elif self.window == "latest_per_client":
            keep = np.zeros(n, bool)
            seen: set[tuple[int, int]] = set()
            for i in order[::-1].tolist():  # newest first: the latest task of a pair wins
                pair = (int(self.client[i]), int(self.cls[i]))
                if pair not in seen:
                    seen.add(pair)
                    keep[i] = True
        else:  # history_fifo: the newest ``cap`` entries of each class
            keep = np.zeros(n, bool)
            for c in np.unique(self.cls):
                keep[order[self.cls[order] == c][-self.cap :]] = True
        if self.rounds > 0:
            keep &= self.round > round_ - self.rounds
        self._select(keep)

    def _select(self, keep: npt.NDArray[np.bool_]) -> None:
        for name in _FIELDS:
            setattr(self, name, getattr(self, name)[keep])

    def means(self, encoding: Literal["raw", "f16"] = "raw") -> FeatureLogitSet | None:
        """Per-class mean feature and logit over kept entries (weighted by :meth:`entry_weights`);
        ``counts`` are the samples behind each class. None while the table is empty."""
        if not len(self):
            return None
        ids = np.unique(self.cls)
        w = self.entry_weights()
        feats = np.zeros((ids.size, self.features.shape[1]), np.float64)
        logits = np.zeros((ids.size, self.num_classes), np.float64)
        counts = np.zeros(ids.size, np.int64)
        for j, c in enumerate(ids):
            rows = self.cls == c
            wr = w[rows] / max(w[rows].sum(), 1e-12)
            feats[j] = wr @ self.features[rows].astype(np.float64)
            logits[j] = wr @ self.logits[rows].astype(np.float64)
            counts[j] = self.counts[rows].sum()
        counts = np.minimum(counts, np.iinfo(np.int32).max)
        return FeatureLogitSet(ids, feats, logits, counts, encoding=encoding)  # type: ignore[arg-type]

    def entry_weights(self) -> npt.NDArray[np.float64]:
        """Each kept entry's weight in the class means: its staleness weight, times its count
        when the table is ``count_weighted``."""
        w = self.weight.astype(np.float64)
        return w * self.counts if self.count_weighted else w

    # ----- persistence ----------------------------------------------------------------------
    def to_tensormap(self) -> TensorMap:
        """All kept entries as named arrays (exact: raw encoding)."""
        return TensorMap({name: getattr(self, name) for name in _FIELDS})

    def load_tensormap(self, state: TensorMap) -> None:
        """Restore entries saved by :meth:`to_tensormap`."""
        t = state.tensors
        missing = [f for f in _FIELDS if f not in t and f != "weight"]
        if missing:
            raise ValidationError("state.knowledge", f"arrays {list(_FIELDS)}", missing)
        self.cls, self.client, self.round, self.counts = (
            t[f].astype(np.int64) for f in ("cls", "client", "round", "counts")
        )
        # a state without weights holds only fresh entries
        w = t.get("weight")
        self.weight = np.ones(self.cls.size, np.float32) if w is None else w.astype(np.float32)
        if self.weight.shape != self.cls.shape:
            raise ValidationError(
                "state.knowledge.weight", f"{self.cls.size} weights", self.weight.size
            )
        self.features = t["features"].astype(np.float32).reshape(self.cls.size, -1)
        self.logits = t["logits"].astype(np.float32).reshape(self.cls.size, self.num_classes)


def _or(given: Sequence[Any] | None, default: Any, uploads: Sequence[Any]) -> Sequence[Any]:
    """``given``, or ``default`` for every upload."""
    return [default] * len(uploads) if given is None else given
