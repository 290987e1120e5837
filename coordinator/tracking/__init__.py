"""Experiment tracking: a run's parameters, per-round and per-agent metrics, traffic and
exported ONNX bundles, sent to the tools researchers already use (MLflow, TensorBoard).

A :class:`~coordinator.tracking.follow.RunFollower` reads the run's ``metrics.jsonl`` as the
engine appends to it (the durable record, so the trackers never slow or stop a round) and hands
each step to every configured sink; ``coordinator track RUN_DIR`` does the same for a run that
has finished. A sink that fails is logged once and dropped: tracking never stops a run.

The live view of a run, ``coordinator serve --metrics-port``, is
:mod:`coordinator.tracking.prometheus` (the engine's observer, imported only with that flag).
"""

from coordinator.tracking.follow import TRACKERS, RunFollower, flatten, start_tracking

__all__ = ["TRACKERS", "RunFollower", "flatten", "start_tracking"]
