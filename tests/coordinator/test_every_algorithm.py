"""Every registered algorithm, end to end over the in-memory transport.

On the defaults a new user gets, ``coordinator simulate --algorithm A --agents 3 --rounds 2``
runs every task to the end or stops at once naming the flag it needs: never a run that
"succeeds" while an agent's task failed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import failed_tasks

from coordinator.cli import main
from coordinator.strategies import STRATEGIES


@pytest.mark.slow
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
