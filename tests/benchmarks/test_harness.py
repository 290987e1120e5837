"""The benchmark harness: results file, resume (of a grid, and of a run killed midway), grid
bookkeeping, table cells."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # its own imports

import harness

Record = dict[str, Any]


def spec(method: str, seed: int = 0, alpha: float = 0.1) -> Record:
    return {"method": method, "seed": seed, "alpha": alpha, "hyper": {"lr": 0.01}}


def run(method: str, seed: int, acc: float | None) -> Record:
    return {"spec": spec(method, seed), "acc": acc}


# ----- results file ---------------------------------------------------------------------------
def test_spec_key_ignores_key_order() -> None:
    a = {"b": 1, "a": {"y": 2, "x": 3}}
    b = {"a": {"x": 3, "y": 2}, "b": 1}
    assert harness.spec_key(a) == harness.spec_key(b)
    assert harness.spec_key(a) != harness.spec_key({**a, "b": 2})


def test_save_then_load_round_trips_and_keeps_each_command_once(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "r.json"
    runs, failures = [run("a", 0, 0.5)], [{"spec": spec("b"), "error": "E", "traceback": "T"}]
    harness.save_results(path, runs, failures, command="python x.py --one")
    harness.save_results(path, runs, failures, command="python x.py --two")
    harness.save_results(path, runs, failures, command="python x.py --one")
    doc = json.loads(path.read_text())
    assert list(doc) == ["commands", "runs", "failures"]
    assert doc["commands"] == ["python x.py --one", "python x.py --two"]
    assert harness.load_results(path) == (runs, failures)
    assert not path.with_suffix(".tmp").exists()


def test_load_of_a_missing_file_is_empty_and_the_one_command_form_is_read(
    tmp_path: Path,
) -> None:
    assert harness.load_results(tmp_path / "none.json") == ([], [])
    old = tmp_path / "old.json"  # fedvtc_repro.py's files before the harness
    old.write_text(json.dumps({"command": "python old.py", "runs": [run("a", 0, 0.1)]}))
    assert harness.load_results(old) == ([run("a", 0, 0.1)], [])
    harness.save_results(old, [], [], command="python new.py")
    assert json.loads(old.read_text())["commands"] == ["python old.py", "python new.py"]


def test_merge_adds_only_the_other_files_new_runs_and_clears_their_failures(
    tmp_path: Path,
) -> None:
    ours, theirs = tmp_path / "ours.json", tmp_path / "gpu.json"
    failed = {"spec": spec("b", 1), "error": "E", "traceback": "T"}
    other_failure = {"spec": spec("c", 0), "error": "E", "traceback": "T"}
    harness.save_results(ours, [run("a", 0, 0.5)], [failed, other_failure], command="here")
    # the lease's file: a copy of ours (a's run measured again there) plus two new runs
    lease_runs = [run("a", 0, 0.9), run("b", 1, 0.7), run("b", 2, 0.6)]
    harness.save_results(theirs, lease_runs, [], command="there")
    assert harness.merge_results(ours, theirs) == 2
    runs, failures = harness.load_results(ours)
    assert runs == [run("a", 0, 0.5), run("b", 1, 0.7), run("b", 2, 0.6)]  # ours kept
    assert failures == [other_failure]
    assert json.loads(ours.read_text())["commands"] == ["here", "there"]
    assert harness.merge_results(ours, theirs) == 0  # idempotent
    assert harness.load_results(ours)[0] == runs


def test_a_grid_keeps_the_runs_another_process_saved_to_its_file_meanwhile(
    tmp_path: Path,
) -> None:
    out = tmp_path / "r.json"

    def execute(s: Record) -> Record:  # while this run goes on, another grid saves one
        harness.save_results(out, [run("other", 7, 0.3)], [], command="other")
        return {"spec": s, "acc": 0.5}

    runs, _ = harness.run_grid(out, [spec("a")], execute, describe=str)
    saved = harness.load_results(out)[0]
    assert {r["spec"]["method"] for r in saved} == {"a", "other"}
    assert saved == runs


def test_a_spec_another_process_recorded_meanwhile_keeps_that_run_only(tmp_path: Path) -> None:
    out = tmp_path / "r.json"

    def execute(s: Record) -> Record:  # another grid finishes the same spec first
        harness.save_results(out, [run("a", 0, 0.3)], [], command="other")
        return {"spec": s, "acc": 0.5}

    harness.run_grid(out, [spec("a")], execute, describe=str)
    assert harness.load_results(out) == ([run("a", 0, 0.3)], [])  # once, the first recorded


def test_pending_keeps_order_and_skips_only_recorded_runs() -> None:
    specs = [spec("a", 0), spec("b", 0), spec("a", 1)]
    recorded = [{"spec": {**spec("b", 0)}}]
    assert harness.pending(specs, recorded) == [spec("a", 0), spec("a", 1)]
    changed = [{"spec": {**spec("a", 0), "hyper": {"lr": 0.1}}}]  # other settings: not done
    assert harness.pending(specs, changed) == specs


# ----- a grid ---------------------------------------------------------------------------------
def fake_execute(s: Record) -> Record:
    if s["method"] == "boom":
        raise RuntimeError("exploded")
    return {"spec": s, "acc": 0.5}


def test_run_grid_records_successes_and_failures_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "grid.json"
    specs = [spec("ok", 0), spec("boom", 0), spec("ok", 1)]
    runs, failures = harness.run_grid(out, specs, fake_execute, describe=str, code="abc")
    assert [r["spec"] for r in runs] == [spec("ok", 0), spec("ok", 1)]
    assert all(r["code"] == "abc" for r in runs)
    assert [f["spec"] for f in failures] == [spec("boom", 0)]
    assert failures[0]["error"] == "RuntimeError: exploded"
    assert "exploded" in failures[0]["traceback"]
    assert harness.load_results(out) == (runs, failures)

    # the next invocation runs only the failed spec again; its failure replaces the old one
    calls: list[Record] = []

    def counting(s: Record) -> Record:
        calls.append(s)
        return fake_execute(s)

    runs2, failures2 = harness.run_grid(out, specs, counting, describe=str)
    assert calls == [spec("boom", 0)]
    assert runs2 == runs and len(failures2) == 1


def test_a_retried_failure_that_succeeds_leaves_the_failures(tmp_path: Path) -> None:
    out = tmp_path / "grid.json"
    harness.save_results(out, [], [{"spec": spec("a"), "error": "E", "traceback": "T"}])
    runs, failures = harness.run_grid(out, [spec("a")], fake_execute, describe=str)
    assert [r["spec"] for r in runs] == [spec("a")] and failures == []


def test_guarded_keeps_the_errors_logged_during_a_failed_run() -> None:
    def noisy(s: Record) -> Record:
        log = logging.getLogger("edgefl.test")
        log.error("agent refused: %s", "one architecture")
        log.error("agent refused: %s", "one architecture")  # kept once
        log.warning("not an error")
        raise ValueError("no quorum")

    r = harness.guarded(noisy, spec("a"))
    assert r["error"] == "ValueError: no quorum"
    assert r["log"] == ["edgefl.test: agent refused: one architecture"]
    assert not any(isinstance(h, harness._ErrorLog) for h in logging.getLogger().handlers)


# ----- step records ---------------------------------------------------------------------------
def test_final_step_falls_back_to_the_last_step() -> None:
    steps: list[Record] = [
        {"phase": "train", "round": 1},
        {"phase": "final"},
        {"phase": "train", "round": 2},
    ]
    assert harness.final_step(steps) == {"phase": "final"}
    assert harness.final_step(steps[:1]) == steps[0]
    assert harness.train_steps(steps) == [steps[0], steps[2]]


def test_step_bytes_by_direction_with_and_without_progress() -> None:
    step = {"bytes": {"tx.task": 100, "tx.running": 5, "rx.reply": 40, "rx.progress": 7}}
    assert harness.step_bytes(step, "tx") == 105
    assert harness.step_bytes(step, "rx") == 47
    assert harness.step_bytes(step, "rx", progress=False) == 40


def test_mean_of_skips_missing_and_non_numeric_values() -> None:
    records: list[Record] = [{"a": 1}, {"a": 0.5}, {"a": None}, {"b": 3}, {"a": "x"}]
    assert harness.mean_of(records, "a") == 0.75
    assert harness.mean_of(records, "c") is None


def test_personalised_accuracy_weights_each_client_by_its_test_split() -> None:
    agents: dict[str, Record] = {
        "agent0": {"acc_local": 1.0},
        "agent2": {"acc_local": 0.5},
        "agent1": {"acc_local": None},  # no evaluation: left out
    }
    # 10 samples at 100 % and 30 at 50 %: 25 of 40 right (the unweighted mean would be 75 %)
    assert harness.personalised_accuracy(agents, [10, 99, 30]) == 0.625
    assert harness.personalised_accuracy({"agent1": {"acc_local": None}}, [1, 2]) is None


# ----- table cells ----------------------------------------------------------------------------
def test_mean_sd_scales_and_formats() -> None:
    assert harness.mean_sd([0.5, 0.7, None]) == "60.0 ± 14.1"
    assert harness.mean_sd([0.123]) == "12.3 ± 0.0"
    assert harness.mean_sd([None]) == "–"
    assert harness.mean_sd([1234.0, 1236.0], scale=1.0, digits=0) == "1235 ± 1"
    assert harness.mean_cell([1.0, 2.0, None]) == "1.50"
    assert harness.mean_cell([]) == "–"


def test_ci95_uses_the_student_t_quantile() -> None:
    mean, half = harness.ci95([1.0, 2.0, 3.0])  # sd 1, n 3, t(2) = 4.303
    assert mean == 2.0
    assert half == pytest.approx(4.303 / math.sqrt(3))
    assert math.isnan(harness.ci95([1.0])[1])
    many = [float(i % 2) for i in range(40)]  # df 39: beyond the table, the normal 1.96
    assert harness.ci95(many)[1] == pytest.approx(1.96 * 0.5063696835418333 / math.sqrt(40))
    assert harness.ci_cell([0.01, 0.02, 0.03]) == "+2.0 [-0.5, +4.5]"


def test_paired_diffs_pair_by_seed_and_skip_missing_values() -> None:
    a = [run("a", 0, 0.6), run("a", 1, 0.7), run("a", 2, None), run("a", 3, 0.9)]
    b = [run("b", 0, 0.5), run("b", 1, 0.9), run("b", 2, 0.1)]
    assert harness.paired_diffs(a, b, "acc") == pytest.approx([0.1, -0.2])
    assert len(harness.by_seed(a)) == 4
    assert list(harness.group_by(a + b, lambda r: r["spec"]["method"])) == ["a", "b"]


def test_code_label_is_a_short_revision_or_unknown() -> None:
    label = harness.code_label()
    assert label == "unknown" or (label and " " not in label)


def test_a_run_trains_on_the_server_where_told_else_where_its_agents_train(
    tmp_path: Path,
) -> None:
    base = harness.SimRun(
        algorithm="velo", hyper={}, seed=0, rounds=1, clients=2, models=("mlp_s",), device="cpu"
    )
    assert base.config_values(tmp_path)["server_device"] == "cpu"
    split = dataclasses.replace(base, server_device="cuda")
    assert split.config_values(tmp_path)["server_device"] == "cuda"
    assert split.fleet().device == "cpu"  # the agents stay where --device puts them


# ----- a run killed midway ------------------------------------------------------------------
RESUMABLE = harness.SimRun(
    algorithm="fedproto",
    hyper={"local_epochs": 1},
    seed=3,
    rounds=8,
    clients=3,
    models=("mlp_s", "cnn_t1", "mlp_m"),
    feature_dim=16,
    global_test=100,
    run_id="resumable",
)


def _curve(steps: list[Record]) -> list[list[float]]:
    return [[a["acc_local"] for _, a in sorted(s["agents"].items())] for s in steps]


def test_a_run_killed_midway_resumes_from_its_work_dir_to_the_same_curve(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: the run uninterrupted, and the same run in a process killed after round 2
    whole, _ = harness.simulate_run(RESUMABLE, 1)
    folder = tmp_path / f"resumable-{RESUMABLE.key()}"
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED.format(bench=BENCH, run=repr(RESUMABLE), work=tmp_path)],
        env={**os.environ, "PYTHONPATH": str(BENCH.parent)},
    )
    try:
        assert wait_for(lambda: _rounds(folder) >= 2, timeout=120, interval=0.02)
    finally:
        child.kill()
        child.wait()
    assert _rounds(folder) < RESUMABLE.rounds and folder.exists()
    # Execute: the same run again, on the same work dir
    with caplog.at_level(logging.INFO, logger="edgefl.coordinator"):
        resumed, _ = harness.simulate_run(RESUMABLE, 1, tmp_path)
    started = [r.getMessage() for r in caplog.records if "resuming at step" in r.getMessage()]
    assert len(started) == 1 and not started[0].startswith("resuming at step 1 ")
    # Assert: the rounds after the kill are the uninterrupted run's, bit for bit; folder gone
    assert _curve(resumed) == _curve(whole) and len(whole) == RESUMABLE.rounds + 1
    assert not folder.exists()


BENCH = Path(harness.__file__).resolve().parent
_KILLED = (
    "import sys; sys.path.insert(0, '{bench}'); from pathlib import Path; import harness; "
    "from harness import SimRun; harness.simulate_run({run}, 1, Path('{work}'))"
)


def _rounds(folder: Path) -> int:
    metrics = folder / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def test_a_runs_folder_name_follows_its_split_files_content_not_its_path(tmp_path: Path) -> None:
    # Prepare: one split file in two checkouts, and a third with other contents
    here, there, other = (tmp_path / d / "split.npz" for d in ("a", "b", "c"))
    for path, content in ((here, b"same"), (there, b"same"), (other, b"changed")):
        path.parent.mkdir()
        path.write_bytes(content)
    # Execute
    runs = (dataclasses.replace(RESUMABLE, partition_file=str(p)) for p in (here, there, other))
    keys = [run.key() for run in runs]
    # Assert: the same run from another checkout resumes the same folder; a new split does not
    assert keys[0] == keys[1] != keys[2] != RESUMABLE.key()


def test_a_run_that_fails_leaves_no_folder_to_resume(tmp_path: Path) -> None:
    bad = dataclasses.replace(RESUMABLE, hyper={"local_epochs": -1})  # refused before agents
    with pytest.raises(Exception, match="local_epochs"):
        harness.simulate_run(bad, 1, tmp_path)
    assert list(tmp_path.iterdir()) == []  # retried, it starts afresh
