"""The ``edge-agent`` command line: a torch-free ``--help`` and precise start-up errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from coordinator.broker.embedded import free_port
from edge_agent.cli import main


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
