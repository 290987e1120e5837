"""MLflow sink: one MLflow run per edgefl run, in the experiment ``edgefl``.

``uri`` is MLflow's tracking URI (a server ``http://HOST:5000``, ``databricks``, ...); empty
means a file store in the run directory (``RUN_DIR/mlruns``, read with ``mlflow ui
--backend-store-uri RUN_DIR/mlruns`` or MLflow's client). MLflow keeps its file store in
maintenance mode behind ``MLFLOW_ALLOW_FILE_STORE``; the sink allows it for a store of its own.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["EXPERIMENT", "MlflowSink"]

EXPERIMENT = "edgefl"
MAX_PARAM_CHARS = 500  # MLflow refuses longer parameter values


class MlflowSink:
    """Logs through :class:`mlflow.tracking.MlflowClient` (no global active run, so several
    runs of one process do not mix)."""

    name = "mlflow"

    def __init__(self, run_dir: Path, run_name: str, uri: str = "") -> None:
        from mlflow.tracking import MlflowClient

        if not uri:
            store = (run_dir / "mlruns").resolve()
            store.mkdir(parents=True, exist_ok=True)
            uri = store.as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(EXPERIMENT)
        experiment_id = (
            self.client.create_experiment(EXPERIMENT)
            if experiment is None
            else experiment.experiment_id
        )
        self.run_id: str = self.client.create_run(experiment_id, run_name=run_name).info.run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        for key, value in params.items():
            self.client.log_param(self.run_id, key, str(value)[:MAX_PARAM_CHARS])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(_key(k), v, now, step) for k, v in metrics.items()]
        for start in range(0, len(batch), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def log_artifacts(self, folder: Path, name: str) -> None:
        self.client.log_artifacts(self.run_id, str(folder), artifact_path=name)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _key(key: str) -> str:
    """MLflow metric names allow letters, digits, ``_-. /``: anything else becomes ``_``."""
    return "".join(c if c.isalnum() or c in "_-. /" else "_" for c in key)
