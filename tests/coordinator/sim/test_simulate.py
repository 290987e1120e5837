"""Whole runs in one process over the in-memory transport: the same code paths as a fleet."""

import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import failed_tasks

from coordinator.cli import main as cli_main
from coordinator.commands.simulate import simulate_feature_dim
from coordinator.config import load_config
from coordinator.sim import simulate as simulate_module
from coordinator.sim.simulate import (
    GIL_SLICE_MAX_S,
    AgentThreads,
    FleetSpec,
    default_family,
    gil_slice,
    simulate,
)
from protocol.errors import ConfigError
from protocol.transport.base import MemoryBroker, MemoryTransport

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

    def down(step: dict) -> int:  # tasks, and what they share sent once
        return step["bytes"].get("tx.task", 0) + step["bytes"].get("tx.knowledge", 0)

    extra_down = [down(every.metrics[r]) - down(once.metrics[r]) for r in (0, 1)]
    assert extra_down[0] < 0.1 * uploads  # nothing averaged before round 1
    # round 2's tasks carry the averaged generator: one copy for the 3 agents, on the broadcast
    assert extra_down[1] >= 0.9 * uploads / 3


# ----- a user's own split and the reproduction knobs ----------------------------
def _file_split(tmp_path: Path, clients: int = 3) -> Path:
    from edge_agent.data import (
        PartitionSpec,
        load_dataset,
        make_federated_split,
        save_partition_file,
    )

    spec = PartitionSpec(
        scheme="dirichlet", alpha=0.5, num_clients=clients, seed=7, global_test_size=100
    )
    return save_partition_file(
        tmp_path / "split.npz", make_federated_split(load_dataset("digits"), spec)
    )


def _cfg(tmp_path: Path, rounds: int = 2):
    return load_config(
        None,
        ["hyper.local_epochs=1"],
        algorithm="fedproto",
        rounds=rounds,
        run_dir=str(tmp_path / "run"),
        min_agents=3,
        deadline_s=120.0,
        run_id="test-file",
    )


def test_agents_train_on_the_partition_file(tmp_path: Path) -> None:
    from coordinator.sim.simulate import agent_options
    from edge_agent.data import load_partition_file
    from edge_agent.factory import build_agent
    from protocol.transport.base import MemoryBroker, MemoryTransport

    path = _file_split(tmp_path)
    fleet = FleetSpec(num_agents=3, models=MODELS, data="digits", partition_file=str(path))
    pf = load_partition_file(path)
    for i in range(3):
        opts = agent_options(_cfg(tmp_path), fleet, i)
        agent = build_agent(opts, MemoryTransport(MemoryBroker(), opts.device_id))
        assert len(agent.ctx.train) == len(pf.train[i])
        assert len(agent.ctx.test) == len(pf.test[i])
        assert agent.ctx.global_test is not None and len(agent.ctx.global_test) == 100
    result = simulate(_cfg(tmp_path), fleet)
    assert [m["phase"] for m in result.metrics] == ["train", "train", "final"]


def test_partition_file_client_count_must_match_the_fleet(tmp_path: Path) -> None:

    path = _file_split(tmp_path, clients=4)
    fleet = FleetSpec(num_agents=3, models=MODELS, data="digits", partition_file=str(path))
    with pytest.raises(ConfigError, match=r"holds 4 clients .* fleet has 3"):
        simulate(_cfg(tmp_path), fleet)


def test_split_knobs_reach_the_agents(tmp_path: Path) -> None:
    from coordinator.sim.simulate import agent_options

    fleet = FleetSpec(
        num_agents=3,
        models=MODELS,
        test_fraction=0.3,
        min_size=25,
        partition_seed=5,
        global_test_size=50,
        eval_every=4,
        global_eval_every=3,
    )
    opts = agent_options(_cfg(tmp_path), fleet, 1)
    assert opts.partition is not None
    assert (opts.partition.test_fraction, opts.partition.min_size) == (0.3, 25)
    assert (opts.partition.seed, opts.partition.global_test_size) == (5, 50)
    assert (opts.eval_every, opts.global_eval_every) == (4, 3)


def test_eval_every_skips_the_rounds_between(tmp_path: Path) -> None:
    fleet = FleetSpec(num_agents=3, models=MODELS, global_test_size=100, eval_every=2)
    result = simulate(_cfg(tmp_path, rounds=3), fleet)
    evaluated = [m["mean_acc_local"] is not None for m in result.metrics]
    assert [m["phase"] for m in result.metrics] == ["train"] * 3 + ["final"]
    assert evaluated == [False, True, False, True]  # rounds 2 and the final step


def test_global_eval_every_scores_the_global_set_only_in_its_rounds(tmp_path: Path) -> None:
    fleet = FleetSpec(num_agents=3, models=MODELS, global_test_size=100, global_eval_every=2)
    result = simulate(_cfg(tmp_path, rounds=3), fleet)
    own = [m["mean_acc_local"] is not None for m in result.metrics]
    shared = [m["mean_acc_global"] is not None for m in result.metrics]
    assert own == [True] * 4  # every round scores the agents' own splits
    assert shared == [False, True, False, True]  # the global set: round 2 and the final step


def test_the_runs_eval_every_from_its_config_reaches_every_agent(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        ["hyper.local_epochs=1", "hyper.eval_every=3"],  # as `[hyper] eval_every = 3` in TOML
        algorithm="fedproto",
        rounds=3,
        run_dir=str(tmp_path / "run"),
        min_agents=3,
        deadline_s=120.0,
        run_id="test-eval-every",
    )
    fleet = FleetSpec(num_agents=3, models=MODELS, global_test_size=100)  # agents: every round
    result = simulate(cfg, fleet)
    evaluated = [m["mean_acc_local"] is not None for m in result.metrics]
    assert evaluated == [False, False, True, True]  # round 3 and the final step


def test_an_eval_every_below_one_is_refused_with_its_bounds(tmp_path: Path) -> None:
    from protocol.errors import ConfigError

    with pytest.raises(ConfigError, match=r"eval_every must be in \[1, 1e\+06\]"):
        load_config(None, ["hyper.eval_every=0"], algorithm="fedproto", run_dir=str(tmp_path))


def test_the_gil_slice_grows_a_millisecond_an_agent_between_the_default_and_its_cap() -> None:
    assert gil_slice(1, 0.005) == 0.005  # one agent: CPython's own
    assert gil_slice(20, 0.005) == pytest.approx(0.020)
    assert gil_slice(100, 0.005) == pytest.approx(GIL_SLICE_MAX_S)
    assert gil_slice(10_000, 0.005) == GIL_SLICE_MAX_S
    assert gil_slice(3, 0.5) == 0.5  # a process that chose a longer one keeps it


@pytest.mark.parametrize("networked", [True, False])
def test_a_process_hosting_networked_agents_lengthens_its_gil_slice_until_they_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, networked: bool
) -> None:
    # Prepare: 5 ms an agent, so three agents ask for 15 ms
    monkeypatch.setattr(simulate_module, "GIL_SLICE_PER_AGENT_S", 0.005)
    before = sys.getswitchinterval()
    broker = MemoryBroker()
    cfg = load_config(None, [], algorithm="fedproto", rounds=1, run_dir=str(tmp_path))
    fleet = FleetSpec(num_agents=3, models=MODELS, data="digits", feature_dim=8)
    agents = AgentThreads(
        cfg,
        fleet,
        lambda cid, will: MemoryTransport(broker, cid, will=will),
        networked=networked,
    )

    # Execute / Assert: networked, the slice follows the agents started; else it stays the
    # process's; after close it is the process's again either way
    try:
        agents.start(0)
        assert sys.getswitchinterval() == pytest.approx(max(before, 0.005) if networked else before)
        agents.start(1)
        agents.start(2)
        assert sys.getswitchinterval() == pytest.approx(max(before, 0.015) if networked else before)
    finally:
        agents.close()
    assert sys.getswitchinterval() == before


def test_simulated_fedktl_agents_build_the_feature_size_its_etf_needs(tmp_path: Path) -> None:
    # Prepare: no --feature-dim; the procedural generator keeps the test free of the wheel
    run_dir = tmp_path / "ktl"
    argv = ["simulate", "--algorithm", "fedktl", "--agents", "3", "--rounds", "1"]
    argv += ["--run-dir", str(run_dir), "--set", "hyper.generator=cppn"]
    argv += ["--set", "hyper.server_epochs=2", "--global-test-size", "100"]
    # Execute
    code = cli_main(argv)
    # Assert: every task of the run succeeded (before, each failed on the ETF's size)
    assert code == 0
    assert failed_tasks(run_dir) == []
    assert simulate_feature_dim(load_config(None, [], algorithm="fedktl"), None) == 10
    assert simulate_feature_dim(load_config(None, [], algorithm="fedproto"), None) == 64
    assert simulate_feature_dim(load_config(None, [], algorithm="fedktl"), 0) is None


def test_a_fleet_of_a_feature_size_the_algorithm_refuses_fails_before_starting(
    tmp_path: Path,
) -> None:
    cfg = load_config(None, [], algorithm="fedktl", rounds=1, run_dir=str(tmp_path / "r"))
    fleet = FleetSpec(num_agents=3, models=MODELS, feature_dim=64)
    with pytest.raises(
        ConfigError, match="fedktl needs 10-dimensional features, the fleet's are 64"
    ):
        simulate(cfg, fleet)
    assert not (tmp_path / "r").exists()  # nothing started


def test_a_simulation_whose_agents_are_refused_stops_at_once_with_the_reason(
    tmp_path: Path,
) -> None:
    # Prepare: a run of 5 classes for digits' 10: every agent is refused at registration
    cfg = load_config(
        None, ["run.num_classes=5"], algorithm="fedproto", rounds=1, run_dir=str(tmp_path / "r")
    )
    fleet = FleetSpec(num_agents=3, models=MODELS, feature_dim=8)
    # Execute / Assert: not the QuorumError of a coordinator that waited wait_agents_s (300 s)
    with pytest.raises(ConfigError, match=r"simulated agents were refused \(agent\d: it has 10 "):
        simulate(cfg, fleet)


@pytest.mark.parametrize("name", ["fedavg", "ccvr"])
def test_a_mixed_fleet_for_an_algorithm_averaging_whole_models_fails_before_starting(
    tmp_path: Path, name: str
) -> None:
    cfg = load_config(None, [], algorithm=name, rounds=1, run_dir=str(tmp_path / "r"))
    fleet = FleetSpec(num_agents=3, models=MODELS, feature_dim=8)
    with pytest.raises(ConfigError, match=f"{name} averages whole models.* --family homo_mlp"):
        simulate(cfg, fleet)
    assert not (tmp_path / "r").exists()  # nothing started


def test_simulate_without_a_family_gives_an_algorithm_averaging_whole_models_one_architecture(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: the command as a new user types it, no --family
    caplog.set_level("INFO")
    run_dir = tmp_path / "avg"
    argv = ["simulate", "--algorithm", "fedavg", "--agents", "3", "--rounds", "1"]
    # Execute
    code = cli_main([*argv, "--run-dir", str(run_dir), "--global-test-size", "100"])
    # Assert: it ran, on one architecture, and said so
    assert code == 0
    assert failed_tasks(run_dir) == []
    assert "fedavg averages whole models: the fleet runs the one-architecture family homo_mlp" in (
        caplog.text
    )
    assert default_family("fedproto") == "tiny"


def test_a_simulated_steps_default_deadline_grows_with_the_agents_sharing_a_core() -> None:
    from coordinator.commands.simulate import simulated_deadline

    assert simulated_deadline(1, cores=2) == 120.0
    assert simulated_deadline(3, cores=2) == 240.0
    assert simulated_deadline(20, cores=2) == 1200.0


def test_a_deadline_the_user_gives_wins_over_the_simulations_default(tmp_path: Path) -> None:
    from coordinator.cli import build_parser
    from coordinator.commands.options import run_config

    argv = ["simulate", "--agents", "30", "--run-dir", str(tmp_path / "r")]
    args = build_parser().parse_args(argv)
    chosen = build_parser().parse_args([*argv, "--set", "run.deadline_s=50"])
    assert run_config(args, defaults={"deadline_s": 999.0}).deadline_s == 999.0
    assert run_config(chosen, defaults={"deadline_s": 999.0}).deadline_s == 50.0
