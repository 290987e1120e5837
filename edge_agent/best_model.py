"""The device's best round: its validation split, and the checkpoint of the round that scored
best on it.

:class:`ValidationSplit` holds out ``validation_fraction`` of the device's training data when
a task asks for it (``edge_agent/data/validation.py`` chooses the samples). :class:`BestRound`
keeps ``checkpoint.best.pt`` beside the last checkpoint: the round of this run with the highest
``acc_val`` so far (the first of equals), written atomically like the last one, so that a
restarted agent carries on comparing with it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from edge_agent.algorithms.base import EdgeContext
from edge_agent.data.validation import validation_indices, validation_seed
from edge_agent.trainer import TensorData
from models.checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from models.selection import SELECTION_METRIC, best_path, mark_best, selected_value

__all__ = ["BestRound", "ValidationSplit"]


class ValidationSplit:
    """A device's training data, with ``fraction`` of it held out for validation: sets the
    context's ``train`` and ``validation``."""

    def __init__(self, ctx: EdgeContext, device_id: str, log: logging.Logger) -> None:
        self.ctx = ctx
        self.full = ctx.train
        self.seed = validation_seed(device_id)
        self.log = log
        self.fraction = 0.0

    def use(self, fraction: float) -> None:
        """Hold out ``fraction`` (the same samples for the same fraction) in the context: the
        agent calls this with each task's ``validation_fraction`` before anything trains."""
        if fraction == self.fraction:
            return
        self.fraction = fraction
        if fraction <= 0:
            self.ctx.train, self.ctx.validation = self.full, None
            return
        train, held = validation_indices(self.full.y.cpu().numpy(), fraction, self.seed)
        self.ctx.train, self.ctx.validation = _subset(self.full, train), _subset(self.full, held)
        self.log.info("validation split: %d of %d training samples", len(held), len(self.full))


def _subset(data: TensorData, index: object) -> TensorData:
    idx = torch.as_tensor(index, dtype=torch.long, device=data.x.device)
    return TensorData(data.x[idx], data.y[idx])


class BestRound:
    """``checkpoint.best.pt``: the best round of the current run by ``acc_val``."""

    def __init__(self, last: Path, log: logging.Logger) -> None:
        self.path = best_path(last)
        self.log = log
        self.run_id: str | None = None
        self.round: int | None = None
        self.value: float | None = None
        if self.path.exists():
            self._restore()

    def _restore(self) -> None:
        try:
            ckpt = load_checkpoint(self.path)
            value = selected_value(ckpt.meta, str(self.path))
        except CheckpointError as exc:  # a stale or foreign file: the next best replaces it
            self.log.warning("ignoring %s: %s", self.path, exc)
            return
        self.run_id = str(ckpt.meta.get("run_id", ""))
        self.round = ckpt.meta.get("round")
        self.value = value

    def offer(self, run_id: str, round_: int, value: float | None, ckpt: Checkpoint) -> bool:
        """Keep ``ckpt`` when ``value`` (its round's ``acc_val``) beats this run's best; a best
        of another run is dropped first. ``True`` when ``ckpt`` became the best."""
        if self.run_id is not None and self.run_id != run_id:
            self.path.unlink(missing_ok=True)
            self.run_id = self.round = self.value = None
        if value is None or (self.value is not None and value <= self.value):
            return False
        save_checkpoint(self.path, mark_best(ckpt, value))
        self.run_id, self.round, self.value = run_id, round_, value
        self.log.info("round %d is the best so far: %s %.4f", round_, SELECTION_METRIC, value)
        return True
