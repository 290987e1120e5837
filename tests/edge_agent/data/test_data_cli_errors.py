"""``edge-agent`` start-up errors about its data and logging: one line, exit 2, no traceback."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_agent.cli import main


def _agent(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    # Port 1 is never listened on; every case below fails before any connection attempt.
    code = main(["--broker", "127.0.0.1:1", "--id", "dev1", "--no-export", *argv])
    return code, capsys.readouterr().err


def _one_error_line(err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edge-agent: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def _truncated(tmp_path: Path) -> Path:
    path = tmp_path / "cut.npz"
    np.savez(path, x=np.zeros((20, 1, 8, 8), np.float32), y=np.arange(20) % 10)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def _noise(tmp_path: Path) -> Path:
    path = tmp_path / "noise.npz"
    path.write_bytes(np.random.default_rng(0).bytes(2000))
    return path


@pytest.mark.parametrize(
    ("make", "fragments"),
    [
        (_truncated, ("cut.npz", "truncated or corrupt .npz")),
        (_noise, ("noise.npz", "not an .npz archive")),
        (lambda tmp: tmp / "no_such_dir/", ("no_such_dir", "does not exist")),
    ],
    ids=["truncated-npz", "random-bytes", "missing-directory"],
)
def test_bad_data_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: object, fragments: tuple[str, ...]
) -> None:
    data = make(tmp_path)  # type: ignore[operator]
    code, err = _agent(capsys, "--data", str(data))
    assert code == 2
    _one_error_line(err, *fragments)


def test_unknown_log_level_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _agent(capsys, "--log-level", "verbose")  # not a ValueError traceback
    assert code == 2
    _one_error_line(err, "--log-level", "'verbose'", "DEBUG, INFO, WARNING, ERROR")
