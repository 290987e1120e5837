"""Which of a device's two checkpoints a model is exported from: its best round or its last.

An agent with a validation split (``hyper.validation_fraction``) keeps, beside its last
checkpoint ``checkpoint.pt``, the checkpoint of its best round by its own validation accuracy,
``checkpoint.best.pt``; that file's ``meta.selection`` names the metric and its value, and its
``meta.round`` the round. :func:`choose` picks one of them for an export (``edge-export
--checkpoint best|last``, the agent's own export at the end of a run) and says which round it
is; without a best checkpoint beside the last one, best is the last.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from models.checkpoint import Checkpoint, CheckpointError, load_checkpoint

__all__ = [
    "CHOICES",
    "SELECTION_METRIC",
    "Selection",
    "best_path",
    "choose",
    "mark_best",
    "selected_value",
]

CHOICES = ("best", "last")
SELECTION_METRIC = "acc_val"  # the agent's accuracy on its own validation split
Choice = Literal["best", "last"]


def best_path(last: Path) -> Path:
    """The best checkpoint kept beside the last one: ``checkpoint.pt`` ->
    ``checkpoint.best.pt``."""
    return last.with_name(f"{last.stem}.best{last.suffix}")


def mark_best(ckpt: Checkpoint, value: float) -> Checkpoint:
    """``ckpt`` as the best round's: ``meta.selection`` names the metric and its value."""
    meta = {**ckpt.meta, "selection": {"metric": SELECTION_METRIC, "value": float(value)}}
    return Checkpoint(ckpt.model_spec, ckpt.state_dict, ckpt.head, meta, ckpt.extra)


def selected_value(meta: Mapping[str, Any], where: str) -> float | None:
    """The validation accuracy a best checkpoint was chosen by (None: not a best checkpoint).

    Raises:
        CheckpointError: ``meta.selection`` is there but malformed.
    """
    selection = meta.get("selection")
    if selection is None:
        return None
    value = selection.get("value") if isinstance(selection, Mapping) else None
    metric = selection.get("metric") if isinstance(selection, Mapping) else None
    if (
        metric != SELECTION_METRIC
        or isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
    ):
        raise CheckpointError(
            f"{where}.meta.selection: expected {{'metric': {SELECTION_METRIC!r}, 'value': a "
            f"finite number}}, got {selection!r}"
        )
    return float(value)


@dataclass(frozen=True)
class Selection:
    """The checkpoint an export reads, and why."""

    checkpoint: Choice  # which one was exported
    path: Path
    round: int | None  # its meta.round
    value: float | None  # its validation accuracy (a best checkpoint's)
    note: str  # one line for the user

    def to_dict(self) -> dict[str, Any]:
        """The bundle's record of it (``manifest.json``, ONNX metadata)."""
        return {
            "checkpoint": self.checkpoint,
            "file": self.path.name,
            "round": self.round,
            "metric": SELECTION_METRIC if self.value is not None else "",
            "value": self.value,
            "note": self.note,
        }


def choose(path: Path, which: str = "best") -> Selection:
    """The checkpoint to export for ``path`` (a last checkpoint, or a best one itself).

    ``best``: ``path`` when it is a best checkpoint, else the best one beside it when it belongs
    to the same run, else ``path`` (said in the note). ``last``: ``path`` as given.

    Raises:
        CheckpointError: ``which`` is unknown, or a checkpoint is missing or unreadable.
    """
    if which not in CHOICES:
        raise CheckpointError(f"--checkpoint: expected best or last, got {which!r}")
    given = load_checkpoint(path)
    value = selected_value(given.meta, str(path))
    if which == "last" or value is not None:
        kind: Choice = "best" if value is not None else "last"
        return Selection(kind, path, _round(given), value, f"{path.name} as given")
    beside = best_path(path)
    if not beside.is_file():
        why = "no best checkpoint beside it (no validation split): best is the last"
        return Selection("last", path, _round(given), None, why)
    best = load_checkpoint(beside)
    best_value = selected_value(best.meta, str(beside))
    if best_value is None or best.meta.get("run_id") != given.meta.get("run_id"):
        why = f"{beside.name} is of another run: the last checkpoint is exported"
        return Selection("last", path, _round(given), None, why)
    note = f"the best round by {SELECTION_METRIC} ({best_value:.4f})"
    return Selection("best", beside, _round(best), best_value, note)


def _round(ckpt: Checkpoint) -> int | None:
    number = ckpt.meta.get("round")
    return number if isinstance(number, int) and not isinstance(number, bool) else None
