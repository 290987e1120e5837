"""Whole runs in one process over the in-memory transport: the same code paths as a fleet."""

from pathlib import Path

import numpy as np
import pytest

from coordinator.config import load_config
from coordinator.simulate import FleetSpec, simulate

MODELS = ("cnn_t1", "mlp_s", "cnn_t2")


def run(tmp_path: Path, algorithm: str, rounds: int, **hyper: object):
    cfg = load_config(
        None,
        [f"hyper.{k}={v}" for k, v in hyper.items()],
        algorithm=algorithm,
        rounds=rounds,
        run_dir=str(tmp_path / algorithm),
        min_agents=3,
        deadline_s=120.0,
        run_id=f"test-{algorithm}",
    )
    fleet = FleetSpec(
        num_agents=3,
        models=MODELS,
        data="digits",
        partition="dirichlet:0.5",
        feature_dim=32,
        global_test_size=200,
    )
    return simulate(cfg, fleet)


def test_fedproto_run_records_accuracy_and_bytes(tmp_path: Path) -> None:
    result = run(tmp_path, "fedproto", rounds=2, local_epochs=1)
    phases = [m["phase"] for m in result.metrics]
    assert phases == ["train", "train", "final"]
    first = result.metrics[0]
    assert sorted(first["agents"]) == ["agent0", "agent1", "agent2"]
    assert all(0.0 <= a["acc_global"] <= 1.0 for a in first["agents"].values())
    assert first["bytes"]["rx.reply"] > 0 and first["bytes"]["tx.task"] > 0
    # round 1 sends no prototypes down; round 2 does, so its tasks are larger
    assert result.metrics[1]["bytes"]["tx.task"] > first["bytes"]["tx.task"]
    assert (tmp_path / "fedproto" / "metrics.jsonl").read_text().count("\n") == 3


@pytest.mark.slow
def test_fedvtc_end_to_end_finetune_not_worse(tmp_path: Path) -> None:
    result = run(tmp_path, "fedvtc", rounds=3, local_epochs=1, synthetic_per_class=30)
    phases = [m["phase"] for m in result.metrics]
    assert phases == ["train"] * 3 + ["upload_generator", "final"]
    upload, final = result.metrics[-2], result.metrics[-1]
    assert upload["aggregate"]["generators_averaged"] == 3
    assert upload["bytes"]["rx.reply"] > 10 * result.metrics[0]["bytes"]["rx.reply"]
    before = [a["acc_global_before_ft"] for a in final["agents"].values()]
    after = [a["acc_global"] for a in final["agents"].values()]
    assert all(np.isfinite(before)) and all(np.isfinite(after))
    # spec §10.3: fine-tuning must not cost more than one point of mean accuracy
    assert np.mean(after) >= np.mean(before) - 0.01
    sigma = [m["aggregate"]["sigma_mean"] for m in result.metrics[:3]]
    assert all(np.isfinite(sigma)) and all(s > 0 for s in sigma)


@pytest.mark.slow
def test_fedvtc_every_round_exchanges_the_generator(tmp_path: Path) -> None:
    """Table 3's ablation: each training reply carries the generator, each later task the
    averaged one; the one-shot default sends it only in the finalisation phases."""
    once = run(tmp_path / "once", "fedvtc", rounds=2, local_epochs=1, synthetic_per_class=10)
    every = run(
        tmp_path / "every",
        "fedvtc",
        rounds=2,
        local_epochs=1,
        synthetic_per_class=10,
        generator_exchange="every_round",
    )
    assert [m["phase"] for m in every.metrics] == [m["phase"] for m in once.metrics]
    uploads = once.metrics[2]["bytes"]["rx.reply"]  # the one-shot upload of 3 generators
    for r in (0, 1):
        extra_up = every.metrics[r]["bytes"]["rx.reply"] - once.metrics[r]["bytes"]["rx.reply"]
        assert extra_up >= 0.9 * uploads, (r, extra_up, uploads)
    extra_down = [
        every.metrics[r]["bytes"]["tx.task"] - once.metrics[r]["bytes"]["tx.task"] for r in (0, 1)
    ]
    assert extra_down[0] < 0.1 * uploads  # nothing averaged before round 1
    assert extra_down[1] >= 0.9 * uploads  # round 2's tasks carry the averaged generator
