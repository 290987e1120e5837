"""TensorBoard sink: scalars per round in ``RUN_DIR/tensorboard`` (``tensorboard --logdir``),
written with TensorBoard's own event writer (no torch needed)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["TensorBoardSink"]


class TensorBoardSink:
    """Scalars as ``tag`` per round; the parameters as one text summary; the exported
    bundles' paths as text (TensorBoard has no artifact store)."""

    name = "tensorboard"

    def __init__(self, logdir: Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        logdir.mkdir(parents=True, exist_ok=True)
        self.logdir = logdir
        self.writer = EventFileWriter(str(logdir))

    def _write(self, summary: Any, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        self.writer.add_event(Event(summary=summary, step=step, wall_time=_now()))

    def _text(self, tag: str, body: str) -> None:
        """A text summary as TensorBoard's text plugin reads it (its own helper needs
        TensorFlow)."""
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.types_pb2 import DT_STRING

        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        tensor = TensorProto(dtype=DT_STRING, string_val=[body.encode()])
        self._write(Summary(value=[Summary.Value(tag=tag, metadata=meta, tensor=tensor)]), 0)

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._text("params", json.dumps({k: str(v) for k, v in params.items()}, indent=1))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in metrics.items()]
        self._write(Summary(value=values), step)
        self.writer.flush()

    def log_artifacts(self, folder: Path, name: str) -> None:
        files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*.onnx"))
        self._text(name, "\n".join(files) or "(none)")

    def close(self) -> None:
        self.writer.close()


def _now() -> float:
    import time

    return time.time()
