"""The ``edge-agent`` command line: a torch-free ``--help`` and precise start-up errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from coordinator.broker.embedded import free_port
from edge_agent.cli import _options, build_parser, main
from edge_agent.joining import Adopted, adopt
from protocol.algorithms import DEFAULT_FEATURE_DIM
from protocol.contract.messages import CoordinatorState


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys, edge_agent.cli as c\n"
        "try:\n    c.main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        "heavy = [m for m in ('torch', 'torchvision', 'onnx', 'onnxruntime') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "--broker" in proc.stdout


def test_unreachable_broker_is_a_one_line_error(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    code = main(
        [
            "--broker",
            f"127.0.0.1:{port}",
            "--id",
            "dev1",
            "--algorithm",
            "fedproto",
            "--model",
            "mlp_s",
            "--state-dir",
            str(tmp_path / "s"),
            "--no-export",
            "--connect-retry",
            "0",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("edge-agent: error:") and f"127.0.0.1:{port}" in err, err


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--model", "no_such_net"], "no_such_net"),
        (["--data", "no_such_dataset"], "no_such_dataset"),
        (["--id", "bad/id"], "--id: expected 1-64 characters"),
    ],
)
def test_bad_options_are_rejected_before_connecting(
    argv: list[str], fragment: str, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    code = main(
        [
            "--broker",
            f"127.0.0.1:{port}",
            "--state-dir",
            str(tmp_path / "s"),
            "--algorithm",
            "fedproto",
            *argv,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and fragment in err, err


def test_json_log_format_writes_one_object_a_line() -> None:
    import json
    import logging

    from edge_agent.cli import build_parser
    from protocol.logs import JsonFormatter as _JsonFormatter

    record = logging.LogRecord("edgefl.a", logging.WARNING, __file__, 1, "round %d", (2,), None)
    assert json.loads(_JsonFormatter().format(record))["msg"] == "round 2"
    assert build_parser().parse_args(["--broker", "h", "--log-format", "json"]).log_format == "json"


def state(feature_dim: int = 0) -> CoordinatorState:
    return CoordinatorState(
        state="running",
        run_id="r",
        algorithm="fedktl",
        round=0,
        total_rounds=2,
        feature_dim=feature_dim,
    )


@pytest.mark.parametrize(
    ("flags", "announced", "built"),
    [
        ([], 10, 10),  # the run's algorithm requires it: adopted with the algorithm
        ([], 0, DEFAULT_FEATURE_DIM),  # the run requires none
        (["--feature-dim", "32"], 10, 32),  # given: kept (and refused at registration)
        (["--feature-dim", "0"], 10, None),  # native features, as given
    ],
)
def test_an_agent_adopting_the_run_builds_the_feature_size_it_announces(
    flags: list[str], announced: int, built: int | None
) -> None:
    args = build_parser().parse_args(flags)
    adopted = adopt(args, state(announced))
    assert adopted == Adopted("fedktl", (), built)
    assert _options(args, "dev", adopted).feature_dim == built


def test_the_coordinator_announces_the_feature_size_its_algorithm_requires() -> None:
    from coordinator.strategies import create_strategy
    from protocol.algorithms import config_type

    ktl = config_type("fedktl")
    assert create_strategy("fedktl", ktl(), num_classes=10).declared_feature_dim() == 10
    assert create_strategy("fedktl", ktl(etf_dim=16), num_classes=10).declared_feature_dim() == 16
    proto = config_type("fedproto")
    assert create_strategy("fedproto", proto(), num_classes=10).declared_feature_dim() == 0
    assert (
        create_strategy("fedproto", proto(feature_dim=8), num_classes=4).declared_feature_dim() == 8
    )


@pytest.mark.network
def test_a_second_default_agent_in_the_same_directory_is_refused_at_once(
    mosquitto, tmp_path
) -> None:
    # two agents started the same way in one directory: both named after the host, one state
    # directory; the first waits for a run, the second must not take over its session and files
    import os
    import socket
    import time

    from edge_agent.cli import AGENT_LOCK
    from protocol.dir_lock import lock_holder
    from tests.helpers_runtime import clean_env

    argv = [sys.executable, "-m", "edge_agent.cli", "--broker", f"127.0.0.1:{mosquitto.port}"]
    argv += ["--model", "mlp_s", "--data", "digits", "--no-export"]
    env = clean_env(PYTHONPATH=os.pathsep.join(sys.path))
    state_dir = tmp_path / f"edgefl-agent-{socket.gethostname().split('.')[0]}"
    first = subprocess.Popen(argv, cwd=tmp_path, env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while lock_holder(state_dir, AGENT_LOCK) != first.pid:
            assert first.poll() is None and time.monotonic() < deadline, "the first never started"
            time.sleep(0.1)
        second = subprocess.run(
            argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert second.returncode == 2, second.stderr
        assert f"in use by another edge-agent (pid {first.pid})" in second.stderr
        assert "--id" in second.stderr
        assert first.poll() is None  # the first one is left alone
    finally:
        first.terminate()
        first.wait(timeout=30)


def test_a_negative_thread_count_is_refused_at_parse_time(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--broker", "localhost", "--threads", "-1"])
    assert exc.value.code == 2
    assert "--threads: must be >= 0, got -1" in capsys.readouterr().err
