"""The ``coordinator`` command line: a torch-free ``--help`` and precise start-up errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from coordinator.broker.embedded import free_port
from coordinator.cli import build_parser, main

HEAVY = ("torch", "torchvision", "onnx", "onnxruntime", "prometheus_client")


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["serve", "--help"],
        ["ingest-worker", "--help"],
        ["provision", "--help"],
        ["partition", "--help"],
        ["demo", "--help"],
        ["simulate", "--help"],
        ["report", "--help"],
        ["status", "--help"],
        ["runs", "--help"],
        ["stop", "--help"],
        ["config", "--defaults"],
    ],
)
def test_help_does_not_import_heavy_modules(argv: list[str]) -> None:
    code = (
        "import sys, coordinator.cli as c\n"
        f"try:\n    c.main({argv!r})\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage: coordinator" in proc.stdout or "[run] keys" in proc.stdout


def test_unreachable_broker_is_a_one_line_error(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()  # nothing listens there
    code = main(
        [
            "serve",
            "--broker",
            f"127.0.0.1:{port}",
            "--algorithm",
            "fedproto",
            "--run-dir",
            str(tmp_path / "run"),
            "--rounds",
            "1",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("coordinator: error:") and f"127.0.0.1:{port}" in err, err
    assert "Traceback" not in err


def test_unknown_config_key_is_rejected(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["serve", "--set", "run.roundz=3", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "roundz" in err, err


def test_set_takes_several_overrides_and_repeats() -> None:
    from coordinator.cli import build_parser

    args = build_parser().parse_args(
        ["serve", "--set", "run.rounds=5", "hyper.lr=0.05", "--set", "hyper.local_epochs=2"]
    )
    assert args.overrides == ["run.rounds=5", "hyper.lr=0.05", "hyper.local_epochs=2"]


def test_json_log_format_writes_one_object_a_line() -> None:
    import json
    import logging

    from protocol.logs import JsonFormatter as _JsonFormatter

    record = logging.LogRecord("edgefl.x", logging.INFO, __file__, 1, "step %d done", (3,), None)
    line = _JsonFormatter().format(record)
    assert "\n" not in line
    assert json.loads(line) | {"ts": 0} == {
        "ts": 0,
        "level": "INFO",
        "logger": "edgefl.x",
        "msg": "step 3 done",
    }
    assert build_parser().parse_args(["serve", "--log-format", "json"]).log_format == "json"


def test_ingest_workers_without_a_broker_are_refused_naming_why(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the embedded broker (amqtt) has no shared subscriptions: the workers would get no reply
    argv = ["serve", "--set", "run.ingest_workers=2", "--run-dir", str(tmp_path / "run")]
    code = main([*argv, "--port", str(free_port())])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "shared subscription" in err and "--broker" in err and "Traceback" not in err


def test_config_defaults_lists_what_a_preset_changes(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert main(["config", "--defaults", "--preset", "htfllib"]) == 0
    out = capsys.readouterr().out
    assert "fedtgp     proto_weight         0.1 -> 10.0" in out
    assert main(["config", "--defaults", "--preset", "htfllib", "--json"]) == 0
    changes = json.loads(capsys.readouterr().out)["preset"]
    assert {"algorithm": "fedproto", "key": "proto_weight", "default": 1.0, "value": 10.0} in (
        changes
    )
    assert main(["config", "--defaults", "--preset", "no_such_preset"]) == 2
    assert "no algorithm has a preset" in capsys.readouterr().err


def test_config_defaults_lists_an_algorithms_hyper_keys(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import json

    from protocol.algorithms import config_type

    assert main(["config", "--defaults", "--algorithm", "velo"]) == 0
    out = capsys.readouterr().out
    assert "[hyper] keys of velo" in out
    line = next(row for row in out.splitlines() if row.split()[:1] == ["upload_samples"])
    assert line.split()[1:4] == ["int", "default", "0"] and "[0, 65536]" in line
    assert any(row.split()[:2] == ["cvae_loss", "code|elbo"] for row in out.splitlines())
    assert main(["config", "--defaults", "--algorithm", "fedtgp", "--json"]) == 0
    keys = {k["key"]: k for k in json.loads(capsys.readouterr().out)["hyper"]}
    assert set(keys) == set(config_type("fedtgp")().to_dict())
    assert keys["proto_weight"]["default"] == config_type("fedtgp")().proto_weight
    assert main(["config", "--defaults", "--algorithm", "no_such_algorithm"]) == 2
    assert "unknown algorithm 'no_such_algorithm'" in capsys.readouterr().err


def test_config_defaults_aligns_its_columns(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--defaults"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("  ")]
    # the longest run key and the tuple type used to push their rows' columns out
    assert {"max_registrations_per_min", "classes"} <= {r.split()[0] for r in rows}
    assert len({r.index(" default ") for r in rows}) == 1


@pytest.mark.parametrize("command", ["simulate", "serve"])
@pytest.mark.parametrize("algorithm", ["fedvtc", "local"])
def test_an_algorithm_that_cannot_run_buffered_is_refused_before_anything_starts(
    tmp_path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command,
    algorithm,
) -> None:
    import coordinator.broker.embedded
    import coordinator.commands.serve
    import coordinator.sim.simulate

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("a broker or the fleet started before the config was refused")

    monkeypatch.setattr(coordinator.broker.embedded.EmbeddedBroker, "__init__", started)
    monkeypatch.setattr(coordinator.sim.simulate, "simulate", started)
    monkeypatch.setattr(coordinator.commands.serve, "_serve_run", started)
    run_dir = tmp_path / "run"
    argv = [command, "--algorithm", algorithm, "--set", "run.mode=buffered"]
    code = main([*argv, "--rounds", "1", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{algorithm} cannot run buffered" in err and "run.mode = sync" in err, err
    assert "Traceback" not in err and not run_dir.exists()


def test_simulate_refuses_a_negative_thread_count_at_parse_time(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["simulate", "--threads", "-2"])
    assert exc.value.code == 2
    assert "--threads: must be >= 0, got -2" in capsys.readouterr().err
