"""What a finished task leaves on the device: its evaluation (local, validation and global test
sets), its checkpoint (the last one, and the best by validation accuracy) and, in the final
phase, the ONNX export.

:class:`RoundOutputs` is mixed into :class:`~edge_agent.agent.EdgeAgent`, whose state it uses.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from edge_agent.algorithms import EdgeAlgorithm, EdgeContext
from edge_agent.best_model import BestRound
from edge_agent.exporting import export_models
from edge_agent.membership import VERSION
from edge_agent.state import AgentState
from edge_agent.trainer import evaluate
from models.checkpoint import Checkpoint, ModelSpec, save_checkpoint
from protocol.contract.messages import Task

if TYPE_CHECKING:
    from edge_agent.agent import AgentSettings

__all__ = ["RoundOutputs"]


class RoundOutputs:
    """Evaluation, checkpoints and export, for :class:`~edge_agent.agent.EdgeAgent`."""

    # the agent's, set in its __init__
    settings: AgentSettings
    algorithm: EdgeAlgorithm[Any]
    ctx: EdgeContext
    spec: ModelSpec
    state: AgentState
    best: BestRound
    history: list[dict[str, float]]
    log: logging.Logger

    def _evaluates(self, task: Task) -> bool:
        """Whether ``task``'s round is evaluated: every N-th training round, N the larger of
        the run's ``eval_every`` (the task's typed config, parsed by the algorithm's
        ``handle`` before this; none where a stand-in handled it) and this agent's own."""
        cfg = self.algorithm.cfg
        every = max(1, self.settings.eval_every, 1 if cfg is None else cfg.eval_every)
        return task.phase != "train" or task.round % every == 0

    def _evaluate(self, task: Task) -> dict[str, float]:
        out: dict[str, float] = {}
        local = evaluate(self.ctx.model, self.ctx.test, self.algorithm.scores)
        if local.samples:
            out.update(acc_local=local.accuracy, loss_local=local.loss)
        if self.ctx.validation is not None and len(self.ctx.validation):
            val = evaluate(self.ctx.model, self.ctx.validation, self.algorithm.scores)
            out.update(acc_val=val.accuracy, loss_val=val.loss)
        every = max(1, self.settings.global_eval_every)
        due = task.phase != "train" or task.round % every == 0
        if due and self.ctx.global_test is not None and len(self.ctx.global_test):
            glob = evaluate(self.ctx.model, self.ctx.global_test, self.algorithm.scores)
            out.update(acc_global=glob.accuracy, loss_global=glob.loss)
        return out

    def _meta(self, task: Task, metrics: dict[str, float] | None = None) -> dict[str, Any]:
        if metrics is None:
            metrics = dict(self.history[-1]) if self.history else {}
        return {
            "algorithm": self.algorithm.name,
            "round": task.round,
            "phase": task.phase,
            "federation": self.settings.federation,
            "run_id": task.run_id,
            "device_id": self.settings.device_id,
            "class_names": list(self.settings.class_names),
            "toolkit_version": VERSION,
            "metrics": metrics,
        }

    def _checkpoint(self, task: Task, metrics: dict[str, float] | None = None) -> Checkpoint:
        model_state = {k: v.detach().cpu() for k, v in self.ctx.model.state_dict().items()}
        return Checkpoint(
            model_spec=self.spec,
            state_dict=model_state,
            head=self.algorithm.head_spec(),
            meta=self._meta(task, metrics),
            extra=self.algorithm.checkpoint_state(),
        )

    def _save_checkpoint(self, task: Task, metrics: dict[str, float] | None = None) -> None:
        """The last checkpoint, and the best one when this round's ``acc_val`` beats it."""
        ckpt = self._checkpoint(task, metrics)
        save_checkpoint(self.state.checkpoint_path, ckpt)
        self.best.offer(task.run_id, task.round, ckpt.meta["metrics"].get("acc_val"), ckpt)

    def _export_safely(self, task: Task, metrics: dict[str, float]) -> dict[str, float]:
        """A failed export is reported (``onnx_exported = 0``), never loses the run's result."""
        try:
            return self._export(task, metrics)
        except Exception as exc:  # export is a boundary: torch.onnx/onnx/ORT errors land here
            self.log.error("ONNX export failed: %s: %s", type(exc).__name__, exc)
            return {"onnx_exported": 0.0}

    def _export(self, task: Task, metrics: dict[str, float]) -> dict[str, float]:
        """Export the device's model (its best round's: ``export_models``) and extras."""
        if self.settings.export_dir is None:
            return {}
        self._save_checkpoint(task, metrics)
        samples = self.ctx.test if len(self.ctx.test) else self.ctx.train
        return export_models(
            self.state.checkpoint_path,
            self.settings.export_dir,
            (samples.x[:64].cpu().numpy(), samples.y[:64].cpu().numpy()),
            self.algorithm.extra_exports(),
            meta=self._meta(task, metrics),
            state_dir=self.settings.state_dir,
            log=self.log,
        )
