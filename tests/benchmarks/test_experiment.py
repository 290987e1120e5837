"""The one experiment main: presets as defaults, a resumable grid, tables; and the benchmark
scripts' declarations (each preset file matches its script's options, each committed results
page regenerates from its results file)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts' own imports (harness, experiment)

import experiment  # noqa: E402
import harness  # noqa: E402
from experiment.summary import (  # noqa: E402
    best_round,
    bytes_by_kind,
    bytes_by_phase,
    late_mean,
    paired_rows,
    per_arch,
    steps_failed,
)

Record = dict[str, Any]

PRESET = """
[settings]
alphas = [0.5]
seeds = [0, 1]
rounds = 3

[presets.long]
rounds = 9
seeds = [0, 1, 2]

[arms.base]
algorithm = "local"

[arms.better]
algorithm = "local"
hyper = { lr = 0.1 }

[arms.boom]
algorithm = "local"

[report]
pairs = [["better", "base"]]
"""
CALLS: list[Record] = []


def fake_spec(args: argparse.Namespace, method: str, alpha: float, seed: int) -> Record | None:
    if method == "better" and seed == 2:
        return None  # a cell the script leaves out
    arm = EXPERIMENT_PRESET().arms[method]
    return {"method": method, "alpha": alpha, "seed": seed, "rounds": args.rounds, **arm.hyper}


def fake_execute(spec: Record, args: argparse.Namespace) -> Record:
    CALLS.append(spec)
    if spec["method"] == "boom":
        raise RuntimeError("exploded")
    return {"spec": spec, "acc": 0.5 + (0.1 if spec["method"] == "better" else 0.0) * spec["seed"]}


def fake_tables(results: experiment.Results) -> str:
    groups = {m: [r for r in results.runs if r["spec"]["method"] == m] for m in ("base", "better")}
    rows = paired_rows(groups, [("better", "base")], ("acc",), harness.ci_cell, wins="acc")
    return f"planned {len(results.specs)}\n" + "\n".join(rows) + "\n"


_PRESET_DIR: list[Path] = []


def EXPERIMENT_PRESET() -> experiment.Preset:  # noqa: N802 - reads like the scripts' PRESET
    return experiment.load_preset("fake", _PRESET_DIR[0])


@pytest.fixture
def fake(tmp_path: Path) -> experiment.Experiment:
    (tmp_path / "fake.toml").write_text(PRESET)
    _PRESET_DIR[:] = [tmp_path]
    CALLS.clear()

    def add_args(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--rounds", type=int)

    return experiment.Experiment(
        description="a fake grid",
        preset=EXPERIMENT_PRESET(),
        spec=fake_spec,
        execute=fake_execute,
        describe=lambda r: f"acc={r['acc']}",
        tables=fake_tables,
        add_args=add_args,
        jobs=False,
    )


def test_settings_are_defaults_a_named_preset_goes_over_them_and_the_command_line_over_both(
    fake: experiment.Experiment,
) -> None:
    args = experiment.parse_args(fake, [])
    assert (args.rounds, args.seeds, args.alphas) == (3, [0, 1], [0.5])
    assert args.methods == ["base", "better", "boom"]  # every arm, in the file's order
    args = experiment.parse_args(fake, ["--preset", "long", "--seeds", "4"])
    assert (args.rounds, args.seeds) == (9, [4])
    with pytest.raises(SystemExit):
        experiment.parse_args(fake, ["--methods", "unknown"])


def test_a_setting_without_an_option_is_refused(
    fake: experiment.Experiment, tmp_path: Path
) -> None:
    (tmp_path / "fake.toml").write_text(PRESET.replace("rounds = 3", "round = 3"))
    typo = experiment.Experiment(**{**vars(fake), "preset": EXPERIMENT_PRESET()})
    with pytest.raises(ValueError, match="round"):
        experiment.parse_args(typo, [])


def test_main_runs_the_grid_resumes_it_and_writes_the_tables(
    fake: experiment.Experiment, tmp_path: Path
) -> None:
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    argv = ["--preset", "long", "--out", str(out), "--md", str(md), "--code", "abc"]
    results = experiment.main(fake, argv)
    # alphas x seeds x methods, less the cell the spec leaves out
    assert [(s["method"], s["seed"]) for s in results.specs] == [
        ("base", 0), ("better", 0), ("boom", 0),
        ("base", 1), ("better", 1), ("boom", 1),
        ("base", 2), ("boom", 2),
    ]  # fmt: skip
    assert len(CALLS) == 8
    runs, failures = harness.load_results(out)
    assert len(runs) == 5 and all(r["code"] == "abc" for r in runs)
    assert [f["spec"]["method"] for f in failures] == ["boom"] * 3
    # better - base: +0.0 at seed 0, +0.1 at seed 1 (seed 2 has no `better`): 2 seeds, 1 win
    assert md.read_text() == "planned 8\n| better − base | 2 | +5.0 [-58.5, +68.5] | 1/2 |\n"

    CALLS.clear()  # the next call runs only what failed
    experiment.main(fake, argv)
    assert [s["method"] for s in CALLS] == ["boom"] * 3
    assert harness.load_results(out)[0] == runs

    CALLS.clear()
    experiment.main(fake, [*argv, "--table-only"])
    assert CALLS == []
    assert json.loads(out.read_text())["commands"]


def fake_sim_run(spec: Record, args: argparse.Namespace) -> harness.SimRun:
    """The simulation a fake spec would run: what names its folder in the work directory."""
    models = ("mlp_s",)
    return harness.SimRun("local", {}, spec["seed"], spec["rounds"], 1, models, run_id="fake")


def test_progress_reads_a_run_in_progress_from_its_folder_and_runs_nothing(
    fake: experiment.Experiment, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from experiment import progress
    from experiment.main import folder_of

    out, work = tmp_path / "r.json", tmp_path / "work"
    grid = ["--out", str(out), "--rounds", "10", "--seeds", "0"]
    experiment.main(fake, [*grid, "--methods", "base"])
    tracked = experiment.Experiment(**{**vars(fake), "sim_run": fake_sim_run})
    argv = [*grid, "1", "--methods", "base", "better", "--work-dir", str(work), "--progress"]
    args = experiment.parse_args(tracked, argv)

    # better, seed 0: three of its rounds so far (the best the second), as a coordinator
    # writes them in the run's folder; a step that missed its quorum is not a round
    better_spec = fake_spec(args, "better", 0.5, 0)
    assert better_spec is not None
    run = harness.run_folder(fake_sim_run(better_spec, args), work)
    run.mkdir(parents=True)
    rows = [(1, 0.4, True), (2, 0.8, True), (3, 0.6, True), (4, 0.9, False)]
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps(
                {"phase": "train", "round": r, "quorum_met": met, "duration_s": 10.0 * r,
                 "agents": {"agent0": {"acc_local": acc, "num_samples": 5}}}
            ) + "\n"
            for r, acc, met in rows
        )
    )  # fmt: skip
    CALLS.clear()
    capsys.readouterr()
    experiment.main(tracked, argv)
    assert CALLS == []  # --progress runs nothing
    text = capsys.readouterr().out
    assert "4 runs planned: 1 done, 1 in progress, 2 to do; the runs in progress" in text
    assert "| better a=0.5 seed=0 | in progress | 3/10 | 80.00 (r2) | 20.0 | 2 min |" in text

    folder = folder_of(tracked, args)
    states = progress.states(experiment.plan(tracked, args), *harness.load_results(out), folder)
    by = {(s.spec["method"], s.spec["seed"]): s for s in states}
    assert by["base", 0].state == "done" and by["base", 1].state == "to do"
    better = by["better", 0]
    assert (better.state, better.rounds) == ("in progress", 3)
    assert better.best is not None and (better.best.round, better.best.value) == (2, 0.8)
    assert better.s_per_round == 20.0
    # no patience in the spec: every round to the cap may still run
    assert better.left_rounds == (7, 7)


def test_progress_leaves_a_run_the_rounds_between_its_patience_stop_and_its_cap(
    tmp_path: Path,
) -> None:
    from experiment import progress

    # 45 rounds of 60 s, the best at round 40: with patience 20 the run stops at round 60
    # unless a later round beats it, and at the cap (100) at the latest
    (tmp_path / "metrics.jsonl").write_text(
        "".join(
            json.dumps(
                {"phase": "train", "round": r, "duration_s": 60.0,
                 "agents": {"a": {"acc_local": 0.9 if r == 40 else 0.5, "num_samples": 1}}}
            ) + "\n"
            for r in range(1, 46)
        )
    )  # fmt: skip
    spec = {"method": "m", "alpha": 0.1, "seed": 1, "rounds": 100, "patience": 20}
    (state,) = progress.states([spec], [], [], lambda s: tmp_path)
    assert state.left_rounds == (15, 55)
    text = progress.table([state])
    assert (
        "| m a=0.1 seed=1 | in progress | 45/100 | 90.00 (r40) | 60.0 | 15 min to 55 min |" in text
    )
    assert "need 15 min to 55 min more" in text

    # seed 3, to do, is expected to take its method and alpha's finished runs' median: their
    # rounds at their pace (a resumed run's wall time counts its resumed part only)
    finished = [
        {"spec": {**spec, "seed": 2}, "s_per_round": 30.0, "rounds_done": 80, "wall_s": 60.0},
        {"spec": {**spec, "seed": 4}, "wall_s": 1800.0},
        {"spec": {**spec, "seed": 5, "alpha": 1.0}, "wall_s": 9000.0},  # another alpha
    ]
    todo = {**spec, "seed": 3}
    (later,) = progress.states([todo], finished, [], lambda s: tmp_path / "not-started")
    assert (later.state, later.expected_s) == ("to do", 2100.0)  # median of 2400 and 1800
    assert "| m a=0.1 seed=3 | to do | – | – | – | about 35 min |" in progress.table([later])

    # a run whose folder holds no closed round yet is in progress at round 0
    (tmp_path / "not-started").mkdir()
    (first,) = progress.states([todo], finished, [], lambda s: tmp_path / "not-started")
    assert (first.state, first.rounds, first.best, first.left_rounds) == (
        "in progress",
        0,
        None,
        (100, 100),
    )


# ----- the shared reductions --------------------------------------------------------------------
def test_round_reductions_pick_the_best_and_the_late_rounds_means() -> None:
    train: list[Record] = [
        {"round": 1, "mean_acc": 0.2},
        {"round": 2, "mean_acc": 0.9},
        {"round": 3, "mean_acc": None},
        {"round": 4, "mean_acc": 0.4},
    ]
    assert best_round(train, "acc") == 0.9
    assert late_mean(train, "acc", 2) == pytest.approx(0.65)
    assert late_mean(train, "acc", 5) is None
    assert best_round([], "acc") is None
    assert steps_failed([{"status": "failed"}, {"status": "done"}, {}]) == 1


def test_per_arch_and_bytes_group_and_sum() -> None:
    agents: list[Record] = [
        {"arch": "mlp", "acc": 0.5},
        {"arch": "cnn", "acc": 0.9},
        {"arch": "mlp", "acc": 0.7},
    ]
    assert per_arch(agents, ("acc",)) == {"cnn": {"acc": 0.9}, "mlp": {"acc": pytest.approx(0.6)}}
    steps: list[Record] = [
        {"phase": "train", "round": 1, "bytes": {"tx.task": 10, "rx.reply": 4}},
        {"phase": "train", "round": 2, "bytes": {"tx.task": 5}},
        {"phase": "final", "round": 2, "bytes": {"tx.task": 1}},
    ]
    assert bytes_by_kind(steps) == {"tx.task": 16, "rx.reply": 4}
    by_phase = {"train": {"tx.task": 15, "rx.reply": 4}, "final": {"tx.task": 1}}
    assert bytes_by_phase(steps) == by_phase
    late = bytes_by_phase(steps, lambda s: "late" if s["round"] > 1 else "early")
    assert late == {"early": {"tx.task": 10, "rx.reply": 4}, "late": {"tx.task": 6}}


# ----- the scripts' declarations ----------------------------------------------------------------
SCRIPTS = (
    "fedktl_repro",
    "felo_repro",
    "fedtype_repro",
    "fedvtc_repro",
    "fedproto_reference",
    "poisoning",
    "compare",
    "reference",
)


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_preset_setting_is_an_option_of_its_script(name: str) -> None:
    script = importlib.import_module(name)
    for preset in [None, *script.PRESET.named]:
        argv = [] if preset is None else ["--preset", preset]
        args = experiment.parse_args(script.EXPERIMENT, argv)
        assert args.out is not None and args.seeds
        assert experiment.plan(script.EXPERIMENT, args)


# (script, results file, page, arguments): each committed page, regenerated
PAGES = (
    ("fedktl_repro", "fedktl_digits.json", "fedktl_digits.md", []),
    ("fedktl_repro", "fedktl_mnist5k.json", "fedktl_mnist5k.md", []),
    ("felo_repro", "felo_digits.json", "felo_digits.md", []),
    ("felo_repro", "felo_encoding.json", "felo_encoding.md", []),
    ("fedtype_repro", "fedtype_digits.json", "fedtype_digits.md", []),
    ("fedvtc_repro", "fedvtc_seeded.json", "fedvtc_seeded.md", []),
    ("fedproto_reference", "fedproto_reference.json", "fedproto_reference.md", []),
    ("poisoning", "poisoning.json", "poisoning.md", []),
)
# (script, results file, page under docs/results, arguments): pages the docs link
DOC_PAGES = (
    ("reference", "reference.json", "reference.md", []),
    ("reference", "reference_long.json", "reference_long.md", ["--preset", "long"]),
)


@pytest.mark.parametrize(("name", "results", "page", "extra"), DOC_PAGES)
def test_a_results_page_regenerates_from_its_results_file(
    name: str, results: str, page: str, extra: list[str], tmp_path: Path
) -> None:
    script = importlib.import_module(name)
    md = tmp_path / page
    out = BENCH / "results" / results
    argv = ["--out", str(out), "--md", str(md), "--table-only", *extra]
    experiment.main(script.EXPERIMENT, argv)
    assert md.read_text() == (BENCH.parent / "docs" / "results" / page).read_text()


@pytest.mark.parametrize(("name", "results", "page", "extra"), PAGES)
def test_a_committed_page_regenerates_from_its_results_file(
    name: str, results: str, page: str, extra: list[str], tmp_path: Path
) -> None:
    script = importlib.import_module(name)
    md = tmp_path / page
    out = BENCH / "results" / results
    experiment.main(script.EXPERIMENT, ["--out", str(out), "--md", str(md), "--table-only", *extra])
    assert md.read_text() == (BENCH / "results" / page).read_text()
