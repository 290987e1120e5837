"""Every registered algorithm, end to end over the in-memory transport.

On the defaults a new user gets, ``coordinator simulate --algorithm A --agents 3 --rounds 2``
runs every task to the end or stops at once naming the flag it needs: never a run that
"succeeds" while an agent's task failed. On an easy split, every algorithm learns: its agents
end far above chance and above their own first round; and each shows its own exchange. Stopped
midway and started again on its run directory, every algorithm draws the uninterrupted run's
curve.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import failed_tasks

from coordinator.cli import main
from coordinator.config import RunConfig, load_config
from coordinator.sim.simulate import FleetSpec, simulate
from coordinator.strategies import STRATEGIES


@pytest.mark.slow
# the defaults are the papers' models: FedType's ResNet-18 proxy takes minutes on two CPU cores
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_simulate_on_its_defaults_runs_every_task_or_names_the_flag_it_needs(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / name
    argv = ["simulate", "--algorithm", name, "--agents", "3", "--rounds", "2"]
    code = main([*argv, "--run-dir", str(run_dir), "--log-level", "WARNING"])
    err = capsys.readouterr().err
    if code != 0:  # refused before it started: the reason names the flag that fixes it
        assert code == 2 and " --" in err, err
        assert not run_dir.exists()
        return
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["round"] for s in steps if s["phase"] == "train"] == [1, 2]
    assert failed_tasks(run_dir) == []


# what each algorithm's run shows of its own exchange, besides learning (metrics of the run)
Metrics = list[dict[str, Any]]


def _grows_in_round_2(m: Metrics) -> bool:
    """Round 1 sends no knowledge down, round 2 does: its tasks are larger."""
    return bool(m[1]["bytes"]["tx.task"] > m[0]["bytes"]["tx.task"])


OWN_CHECKS: dict[str, Callable[[Metrics], bool]] = {
    "ccvr": lambda m: (
        m[-2]["phase"] == "upload_stats"
        and m[-2]["aggregate"]["calibration_classes"] == 10
        and m[-2]["aggregate"]["head_steps"] > 0
    ),
    "fd": lambda m: m[0]["aggregate"]["classes_with_logits"] == 10 and _grows_in_round_2(m),
    "fedgen": lambda m: (
        m[0]["aggregate"]["generator_steps"] == SERVER_STEPS
        and math.isfinite(m[1]["aggregate"]["generator_loss"])
    ),
    "fedgh": lambda m: m[0]["aggregate"]["head_steps"] > 0 and _grows_in_round_2(m),
    "fedkd": lambda m: (
        m[0]["aggregate"]["aggregated"] == 3
        and all(
            math.isfinite(a["train_loss"]) and 0.0 <= a["shared_acc"] <= 1.0
            for a in m[1]["agents"].values()
        )
    ),
    "fedtgp": lambda m: m[1]["aggregate"]["tgp_steps"] > 0,
    "fml": lambda m: (
        m[0]["aggregate"]["aggregated"] == 3
        and all(
            0.0 <= a["global_shared_acc"] <= 1.0 and 0.0 <= a["shared_acc"] <= 1.0
            for a in m[1]["agents"].values()
        )
        and _grows_in_round_2(m)
    ),
    # only the head travels: 330 floats an upload, where the whole models hold 22142
    "lg_fedavg": lambda m: (
        m[0]["aggregate"]["aggregated"] == 3 and m[0]["bytes"]["rx.reply"] < 22142
    ),
}
SERVER_STEPS = 20
# enough local training that three rounds of 3 agents learn digits; plain SGD for every
# algorithm (the Felo family defaults to Adam at 1e-3), so that one setting suits them all
TRAINING = ["hyper.local_epochs=3", "hyper.lr=0.05", "hyper.optimizer=sgd"]
# sizes that keep each run to seconds on a CPU; the algorithms' exchanges are unchanged
LIGHT = {
    "fedgen": ["hyper.noise_dim=32", "hyper.hidden_dim=32", f"hyper.server_steps={SERVER_STEPS}"],
    "fedktl": ["hyper.generator=cppn", "hyper.server_epochs=5"],
    "fedtype": ["hyper.proxy_model=mlp_xs"],
    "fedvtc": ["hyper.synthetic_per_class=20"],
    "velo": ["hyper.cvae_z_dim=32", "hyper.cvae_embed_dim=32", "hyper.cvae_hidden=64"],
}
ROUNDS = 3
CHANCE = 0.1  # digits: 10 classes


def light_run(name: str, run_dir: Path, partition: str) -> tuple[RunConfig, FleetSpec]:
    """``name`` on 3 digits agents for :data:`ROUNDS` rounds, trained as :data:`TRAINING` and
    sized as :data:`LIGHT` says, split by ``partition``."""
    cfg = load_config(
        None,
        [*TRAINING, *LIGHT.get(name, [])],
        algorithm=name,
        rounds=ROUNDS,
        run_dir=str(run_dir),
        min_agents=3,
        run_id=f"light-{name}",
    )
    one = STRATEGIES[name].one_architecture
    fleet = FleetSpec(
        3,
        ("mlp_s",) if one else ("cnn_t1", "mlp_s", "cnn_t2"),
        partition=partition,
        feature_dim=cfg.required_feature_dim() or 32,
        global_test_size=200,
    )
    return cfg, fleet


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_algorithm_learns_an_easy_split(tmp_path: Path, name: str) -> None:
    # Prepare: digits split iid over 3 agents (every agent holds every class): easy to learn
    cfg, fleet = light_run(name, tmp_path / name, "iid")
    # Execute
    rng = torch.get_rng_state()
    result = simulate(cfg, fleet)
    # Assert: every task ran; the agents end far above chance and above their first round
    assert failed_tasks(tmp_path / name) == []
    # no part drew from torch's global generator outside `seeded`: a draw in one agent's
    # thread moves another's seeded start, and paired runs stop being paired
    assert torch.equal(torch.get_rng_state(), rng)
    train = [m for m in result.metrics if m["phase"] == "train"]
    assert [m["round"] for m in train] == list(range(1, ROUNDS + 1))
    first, last = train[0]["mean_acc_global"], result.metrics[-1]["mean_acc_global"]
    assert len(result.metrics[-1]["agents"]) == 3
    assert last > 5 * CHANCE and last > first, (first, last)
    assert OWN_CHECKS.get(name, lambda m: True)(result.metrics)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_algorithm_interrupted_midway_resumes_to_the_uninterrupted_curve(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the run uninterrupted, then the same run stopped as round 2's step opens (the
    # coordinator's Ctrl-C; its agents stop with it) and started again on its run directory
    from coordinator.engine.core import Coordinator

    def run(run_dir: Path) -> list[dict[str, Any]]:
        return simulate(*light_run(name, run_dir, "dirichlet:1.0")).metrics

    whole = run(tmp_path / "whole")
    original = Coordinator.collect
    stopped: list[int] = []

    def collect(self: Coordinator, rec: Any, step: Any) -> Any:
        if step.round == 2 and not stopped:
            stopped.append(1)
            raise KeyboardInterrupt
        return original(self, rec, step)

    monkeypatch.setattr(Coordinator, "collect", collect)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "resumed")
    # Execute
    resumed = run(tmp_path / "resumed")
    # Assert: no task failed, and every agent's accuracy in every step is the uninterrupted
    # run's, bit for bit: server state, agent checkpoints and random streams all survived
    assert failed_tasks(tmp_path / "resumed") == []

    def curve(metrics: list[dict[str, Any]]) -> list[Any]:
        return [
            (
                m["round"],
                m["phase"],
                sorted((d, a.get("acc_local")) for d, a in m["agents"].items()),
            )
            for m in metrics
        ]

    assert curve(resumed) == curve(whole)
