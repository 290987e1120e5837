"""Early stopping on the agents' validation accuracy, and each device's best round exported,
over a real Mosquitto: the coordinator, three agents and their final ONNX bundles.

The agents' ``acc_val`` is scripted by round (the rest of the run is real: training, the
validation split, the checkpoints, the export), so the round the run stops at and the round
every device exports are known in advance.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coordinator.config import load_config
from coordinator.sim.simulate import simulate
from edge_agent.agent import EdgeAgent
from export.heads import with_head
from export.runtime import make_session, run_batches
from models.checkpoint import build_model, load_checkpoint
from protocol.contract.messages import Task
from protocol.transport.paho import MqttTransport
from tests.helpers_runtime import FLEET

pytestmark = [pytest.mark.network, pytest.mark.slow]

# every agent's acc_val by (phase, round): best at round 2 (round 3 only equals it), so a run
# with patience 2 ends its training after round 4; the final step scores worse than round 2
SCRIPT = {("train", 1): 0.5, ("train", 2): 0.8, ("train", 3): 0.8, ("train", 4): 0.7}
FINAL_VALUE = 0.6
BEST_ROUND, LAST_TRAIN_ROUND = 2, 4


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each agent reports SCRIPT's acc_val (on a real validation split: the key must be there)
    and keeps a copy of its last checkpoint after every task, by phase and round."""
    evaluate, save = EdgeAgent._evaluate, EdgeAgent._save_checkpoint

    def scripted_evaluate(self: EdgeAgent, task: Task) -> dict[str, float]:
        out = evaluate(self, task)
        assert "acc_val" in out  # the agent evaluated its validation split
        out["acc_val"] = SCRIPT.get((task.phase, task.round), FINAL_VALUE)
        return out

    def save_and_copy(self: EdgeAgent, task: Task, metrics: Any = None) -> None:
        save(self, task, metrics)
        copies = self.settings.state_dir / "copies"
        copies.mkdir(exist_ok=True)
        shutil.copy(self.state.checkpoint_path, copies / f"{task.phase}-{task.round}.pt")

    monkeypatch.setattr(EdgeAgent, "_evaluate", scripted_evaluate)
    monkeypatch.setattr(EdgeAgent, "_save_checkpoint", save_and_copy)


def _scores(path: Path, x: np.ndarray) -> np.ndarray:
    ckpt = load_checkpoint(path)
    with torch.no_grad():
        scores, _ = with_head(build_model(ckpt), ckpt.head).eval()(torch.from_numpy(x))
    return np.asarray(scores.numpy())


@pytest.mark.usefixtures("scripted")
def test_the_run_stops_on_validation_and_every_device_exports_its_best_round(
    mosquitto, tmp_path: Path
) -> None:
    # Prepare: patience 2 on the default monitor, which a validation split makes acc_val's
    cfg = load_config(
        None,
        ["hyper.local_epochs=1", "hyper.validation_fraction=0.25"],
        algorithm="fedproto",
        rounds=8,
        patience=2,
        deadline_s=120.0,
        min_agents=3,
        run_id="best",
        run_dir=str(tmp_path / "run"),
    )
    assert cfg.monitored == "acc_val_weighted"
    fleet = dataclasses.replace(FLEET, export=True)

    def factory(client_id: str, will: Any) -> MqttTransport:
        return MqttTransport(client_id=f"edgefl-{client_id}", port=mosquitto.port, will=will)

    # Execute
    simulate(cfg, fleet, transport_factory=factory)
    # Assert: training ended after round 4, the final step ran after it
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [(r["round"], r["phase"]) for r in records] == [
        *((n, "train") for n in range(1, LAST_TRAIN_ROUND + 1)),
        (LAST_TRAIN_ROUND + 1, "final"),
    ]
    stop = records[LAST_TRAIN_ROUND - 1]["stop"]
    assert stop["reason"] == "patience" and stop["monitor"] == "acc_val_weighted"
    assert (stop["best_round"], stop["best"]) == (BEST_ROUND, pytest.approx(0.8))
    x = np.random.default_rng(0).random((32, 1, 8, 8), dtype=np.float32)
    for device, agent in records[-1]["agents"].items():
        assert agent["export_round"] == BEST_ROUND
        state = tmp_path / "run" / "agents" / device
        best = load_checkpoint(state / "checkpoint.best.pt")
        assert best.meta["round"] == BEST_ROUND and best.meta["run_id"] == "best"
        assert best.meta["selection"] == {"metric": "acc_val", "value": pytest.approx(0.8)}
        bundle = tmp_path / "run" / "export" / device
        manifest = json.loads((bundle / "manifest.json").read_text())
        assert manifest["checkpoint"]["checkpoint"] == "best"
        assert manifest["checkpoint"]["round"] == BEST_ROUND
        assert manifest["metadata"]["round"] == str(BEST_ROUND)
        # the bundle's model is round 2's, not the last one's
        exported, _ = run_batches(make_session(bundle / "model.onnx"), x)
        round_two = _scores(state / "copies" / f"train-{BEST_ROUND}.pt", x)
        last = _scores(state / "checkpoint.pt", x)
        np.testing.assert_allclose(exported, round_two, rtol=1e-4, atol=1e-4)
        assert np.abs(exported - last).max() > 1e-2
