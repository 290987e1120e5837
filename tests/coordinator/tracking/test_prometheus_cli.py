"""``coordinator serve --metrics-port``: a clear one-line error for a missing extra and for a
port already taken, before any broker is reached."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.broker.embedded import free_port
from coordinator.cli import main


def _serve(tmp_path: Path, metrics_port: int) -> list[str]:
    broker = f"127.0.0.1:{free_port()}"  # nothing listens: reached only after the exporter
    run_dir = str(tmp_path / "run")
    return ["serve", "--broker", broker, "--run-dir", run_dir, "--metrics-port", str(metrics_port)]


def test_without_the_extra_serve_names_it(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['prometheus_client'] = None  # not installed\n"
        "from coordinator.cli import main\n"
        f"sys.exit(main({_serve(tmp_path, free_port())!r}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 2, proc.stderr
    assert "coordinator: error: --metrics-port needs" in proc.stderr
    assert "pip install edgefl[metrics]" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_metrics_port_taken_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("prometheus_client")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(_serve(tmp_path, port)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"coordinator: error: --metrics-port: cannot listen on 127.0.0.1:{port}")
    assert not (tmp_path / "run").exists()
