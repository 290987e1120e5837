"""Experiment tracking: a step record's flat metrics, the follower of metrics.jsonl, and a
simulated run read back with MLflow's client and TensorBoard's event reader."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from coordinator.config import load_config
from coordinator.sim.simulate import FleetSpec, simulate
from coordinator.tracking import RunFollower, flatten
from protocol.errors import ConfigError

RECORD = {
    "round": 2,
    "phase": "train",
    "duration_s": 1.5,
    "participants": ["a", "b"],
    "failed": {},
    "agents": {
        "a": {"acc_local": 0.5, "acc_global": 0.4, "num_samples": 10, "arch": "mlp_s"},
        "b": {"acc_local": 1.0, "acc_global": 0.6, "num_samples": 30, "arch": "cnn_t1"},
    },
    "aggregate": {"classes": 3.0},
    "bytes": {"rx.reply": 100, "tx.task": 50},
    "bytes_total": 150,
    "mean_acc_local": 0.75,
    "mean_acc_global": 0.5,
}


def test_a_step_record_flattens_to_its_summaries_traffic_and_agents() -> None:
    out = flatten(RECORD)
    assert out["acc_local_weighted"] == pytest.approx((0.5 * 10 + 1.0 * 30) / 40)
    assert out["mean_acc_global"] == 0.5 and out["bytes/rx.reply"] == 100
    assert out["participants"] == 2 and out["aggregate/classes"] == 3.0
    assert out["agent/b/acc_local"] == 1.0 and "agent/a/arch" not in out  # scalars only
    final = flatten({**RECORD, "phase": "final"})
    assert final["final/mean_acc_local"] == 0.75 and "mean_acc_local" not in final


class Recorder:
    def __init__(self, name: str, fail: bool = False) -> None:
        self.name, self.fail = name, fail
        self.steps: list[tuple[int, dict[str, float]]] = []
        self.closed = False

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self.fail:
            raise RuntimeError("tracking server down")
        self.steps.append((step, dict(metrics)))

    def log_artifacts(self, folder: Path, name: str) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_the_follower_sends_complete_lines_once_and_drops_a_failing_sink(tmp_path: Path) -> None:
    good, bad = Recorder("good"), Recorder("bad", fail=True)
    follower = RunFollower(tmp_path, [good, bad])
    path = tmp_path / "metrics.jsonl"
    line = json.dumps(RECORD)
    path.write_text(line + "\n" + line[:20])  # the second record is still being written
    assert follower.poll() == 1
    with path.open("a") as fh:
        fh.write(line[20:] + "\n")
    assert follower.poll() == 1 and follower.poll() == 0
    follower.stop()
    assert [s for s, _ in good.steps] == [2, 2] and good.closed
    assert follower.sinks == [good]  # the failing one was dropped after its first error


def test_an_unknown_tracker_is_refused_with_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="mlflow, tensorboard"):
        load_config(None, ["run.trackers=wandb"], run_dir=str(tmp_path))


def test_a_simulated_run_reads_back_from_mlflow_and_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # Execute: a short run with both trackers
    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        ["hyper.local_epochs=1", "run.trackers=mlflow,tensorboard"],
        algorithm="fedproto",
        rounds=2,
        run_dir=str(run_dir),
        min_agents=3,
        run_id="tracked",
    )
    simulate(cfg, FleetSpec(num_agents=3, models=("cnn_t1", "mlp_s", "cnn_t2")))
    # Assert: each tool holds the rounds' accuracy exactly as metrics.jsonl does
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    want = [(r["round"], r["mean_acc_local"]) for r in rows if r["phase"] == "train"]
    client = MlflowClient((run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("edgefl").experiment_id])
    assert run.info.run_name == "tracked" and run.data.params["algorithm"] == "fedproto"
    history = client.get_metric_history(run.info.run_id, "mean_acc_local")
    assert [m.step for m in history] == [r for r, _ in want]
    assert [m.value for m in history] == pytest.approx([v for _, v in want])
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("mean_acc_local")  # float32 on disk
    assert [e.step for e in scalars] == [r for r, _ in want]
    assert [e.value for e in scalars] == pytest.approx([v for _, v in want], rel=1e-6)
