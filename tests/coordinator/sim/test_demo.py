"""``coordinator demo`` end to end: its defaults (FedProto on MNIST 5k), real agent processes over
the embedded broker, the finalisation phase and verified ONNX bundles; and its summary table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.cli import main
from coordinator.config import RunConfig
from coordinator.engine.core import RunResult
from coordinator.sim.demo import AgentProcessError, DemoSpec, run_demo, summarize


def test_default_demo_runs_fedproto_to_verified_onnx(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "demo"
    code = main(
        [
            "demo",
            "--agents",
            "2",
            "--rounds",
            "1",
            "--run-dir",
            str(run_dir),
            "--log-level",
            "ERROR",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # the reference tier's best-supported method (docs/results/reference.md), FedProto: its
    # training rounds, then the final step
    assert [s["phase"] for s in steps] == ["train", "final"]
    assert "algorithm fedproto" in out
    final = steps[-1]["agents"]
    assert sorted(final) == ["agent0", "agent1"]
    assert all(0.0 <= a["acc_global"] <= 1.0 for a in final.values())
    for dev in final:
        manifest = json.loads((run_dir / "export" / dev / "manifest.json").read_text())
        assert manifest["files"][0]["verification"]["passed"] is True
    assert out.count("| verified |") == 2
    assert "| **mean** |" in out


@pytest.mark.slow
def test_the_demo_runs_without_the_generator_wheel_on_the_procedural_generator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: a pip install without scripts/setup.sh, i.e. without the gan-face-generate wheel
    from models import generators

    monkeypatch.setattr(generators, "DCGAN_FACE_PACKAGE", "gan_face_generate_not_installed")
    run_dir = tmp_path / "demo"
    argv = ["demo", "--agents", "2", "--rounds", "1", "--data", "digits", "--no-export"]
    argv += ["--algorithm", "fedktl"]
    # Execute
    code = main([*argv, "--run-dir", str(run_dir), "--log-level", "WARNING"])
    # Assert: it ran FedKTL to the end on the procedural generator, and said why
    assert code == 0, caplog.text
    assert "needs the gan-face-generate wheel" in caplog.text
    assert "the demo uses the procedural 'cppn' generator instead" in caplog.text
    run = json.loads((run_dir / "run.json").read_text())
    assert (run["algorithm"], run["hyper"]["generator"]) == ("fedktl", "cppn")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["phase"] for s in steps] == ["train", "final"]
    assert all(not s["failed"] for s in steps)


def test_demo_stops_with_the_log_of_an_agent_process_that_died(tmp_path: Path) -> None:
    # one agent gets an unknown architecture and exits at start-up; without the check the
    # coordinator would wait wait_agents_s (an hour here) for it to register
    cfg = RunConfig(algorithm="local", rounds=1, run_dir=str(tmp_path / "run"), wait_agents_s=3600)
    spec = DemoSpec(agents=2, models=("mlp_s", "no_such_model"), data="digits", export=False)
    with pytest.raises(AgentProcessError) as err:
        run_demo(cfg, spec)
    text = str(err.value)
    assert "agent1 exited with code" in text
    assert "unknown model 'no_such_model'" in text  # the agent's own message, from its log
    assert str(tmp_path / "run" / "logs" / "agent1.log") in text


def test_summary_mean_row_skips_missing_values(tmp_path: Path) -> None:
    metrics = [
        {
            "phase": "train",
            "agents": {"a": {"acc_local": 0.5, "acc_global": 0.2}, "b": {"acc_local": 0.7}},
        },
        {
            "phase": "final",
            "agents": {
                "a": {"arch": "mlp_s", "acc_local": 0.6, "acc_global": 0.4},
                "b": {"arch": "cnn_t1", "acc_local": 0.8, "acc_global": 0.6},
            },
        },
    ]
    text = summarize(RunResult(run_id="r", steps=2, metrics=metrics, rejected={}), tmp_path)
    # global at round 1 is known for one agent only: its mean is that agent's value
    assert "| **mean** | | 60.0% -> 70.0% | 20.0% -> 50.0% | |" in text


def test_summary_says_when_no_bundle_was_exported(tmp_path: Path) -> None:
    final = {"phase": "final", "agents": {"a": {"arch": "mlp_s", "acc_local": 0.6}}}
    result = RunResult(run_id="r", steps=1, metrics=[final], rejected={})
    assert "no ONNX bundles written" in summarize(result, tmp_path)
    bundle = tmp_path / "export" / "a"
    bundle.mkdir(parents=True)
    (bundle / "manifest.json").write_text("{}")
    text = summarize(result, tmp_path)
    assert "no ONNX bundles written" not in text
    assert f"bundles: {tmp_path / 'export'}" in text
    assert "| a | mlp_s | n/a -> 60.0% | n/a -> n/a | written |" in text


def test_the_demo_feature_size_is_the_flag_then_the_algorithms_then_the_datasets() -> None:
    from coordinator.commands.demo import demo_feature_dim
    from coordinator.config import load_config

    def cfg(algorithm: str, *overrides: str) -> RunConfig:
        return load_config(None, list(overrides), algorithm=algorithm)

    assert demo_feature_dim(cfg("fedktl"), "mnist5k", None) == 10  # its ETF head: K = C
    assert demo_feature_dim(cfg("fedktl", "hyper.etf_dim=16"), "mnist5k", None) == 16
    assert demo_feature_dim(cfg("fedvtc"), "mnist5k", None) == 980  # its generator's latent
    assert demo_feature_dim(cfg("fedproto"), "digits", None) == 64
    assert demo_feature_dim(cfg("fedktl"), "mnist5k", 32) == 32
