"""benchmarks/compare.py's planning: which runs exist, in which order, and how the page says so."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # its own imports

import compare
import experiment


def test_algorithms_that_average_whole_models_are_left_out_of_a_mixed_fleet_only() -> None:
    assert compare.not_applicable("fedavg", "tiny") is not None
    assert compare.not_applicable("ccvr", "tiny") is not None
    assert compare.not_applicable("fedavg", "homo_mlp") is None
    # a shared module or proxy is averaged, not the models: they run on any fleet
    for name in ("lg_fedavg", "fml", "fedkd", "fedtype", "fedproto"):
        assert compare.not_applicable(name, "tiny") is None


def test_the_grid_starts_with_mnist_and_the_slowest_algorithms() -> None:
    args = compare.parse_args(["--algorithms", "local", "fedvtc", "velo"])
    specs = [
        compare.run_spec(args, alg, data, 0.1, 0)
        for data in ("digits", "mnist5k")
        for alg in ("local", "velo", "fedvtc")
    ]
    order = [(s["data"], s["algorithm"]) for s in compare.schedule(specs)]
    assert order == [
        ("mnist5k", "fedvtc"),
        ("mnist5k", "velo"),
        ("mnist5k", "local"),
        ("digits", "fedvtc"),
        ("digits", "velo"),
        ("digits", "local"),
    ]


def test_the_page_names_skipped_algorithms_and_runs_on_another_device() -> None:
    args = compare.parse_args(["--quick"])
    spec = compare.run_spec(args, "local", "digits", 0.1, 0)
    run = {
        "spec": spec,
        "device": "cuda",
        "acc_personal": 0.8,
        "acc_global": 0.2,
        "down_per_client": 100.0,
        "up_per_client": 100.0,
        "bytes_run": 1000,
        "s_per_round": 0.5,
        "final_agents": 20,
        "wall_s": 5.0,
    }
    text = compare.page(args, [run], [], {"fedavg": "needs one architecture"})
    assert "| `fedavg` | – | not run: needs one architecture |" in text
    assert "1 of 1 runs on cuda" in text


def test_common_training_gives_every_row_one_recipe_and_own_leaves_the_defaults() -> None:
    common = compare.parse_args([])
    own = compare.parse_args(["--train", "own"])
    for alg in ("local", "fedhe", "fedtype", "fedvtc"):
        hyper = compare.run_spec(common, alg, "digits", 1.0, 0)["hyper"]
        assert {k: hyper[k] for k in compare.COMMON_TRAIN} == compare.COMMON_TRAIN
        assert compare.run_spec(own, alg, "digits", 1.0, 0)["hyper"] == compare.NEEDS.get(
            alg, {}
        ).get("hyper", {})
    # the two recipes are different runs, kept in different files and pages
    assert common.out != own.out and common.md != own.md
    assert compare.run_spec(common, "fedtype", "digits", 1.0, 0)["hyper"]["proxy_model"] == "mlp_xs"


def test_an_ablation_is_its_own_row_with_its_settings_over_the_recipe() -> None:
    args = compare.parse_args(["--hyper", "predict=head", "proto_weight=1.0"])
    spec = compare.run_spec(args, "fedtgp", "digits", 1.0, 0)
    plain = compare.run_spec(compare.parse_args([]), "fedtgp", "digits", 1.0, 0)
    assert spec["method"] == "fedtgp[predict=head,proto_weight=1.0]"
    assert spec["hyper"] == {**plain["hyper"], "predict": "head", "proto_weight": 1.0}
    assert compare.spec_key(spec) != compare.spec_key(plain)  # never resumed as the plain run
    figures = {"down_per_client": 1e3, "up_per_client": 2e3, "bytes_run": 1e6, "s_per_round": 1}
    figures["final_agents"] = 20
    run = {"spec": spec, "acc_personal": 0.5, "acc_global": 0.2, **figures}
    table = "\n".join(compare.setting_table([run], [], {}, ["fedtgp"]))
    assert "`fedtgp[predict=head,proto_weight=1.0]` | 1 | **50.0**" in table
    assert "`fedtgp` | 0 | not run yet" in table
    assert "--hyper predict=head proto_weight=1.0" in compare.command(args)


def test_a_call_for_some_algorithms_keeps_every_algorithm_on_the_page(tmp_path: Path) -> None:
    import harness  # benchmarks/harness.py, as compare imports it

    # a call for a few algorithms used to rewrite the one table with only their rows
    figures = {"down_per_client": 1e3, "up_per_client": 2e3, "bytes_run": 1e6, "s_per_round": 1}
    args = compare.parse_args(["--data", "digits", "--seeds", "0", "--alphas", "1.0"])
    runs = [
        {"spec": compare.run_spec(args, alg, "digits", 1.0, 0), "acc_personal": 0.5,
         "acc_global": 0.2, "final_agents": 20, **figures}
        for alg in ("local", "fedproto")
    ]  # fmt: skip
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    harness.save_results(out, runs, [])
    argv = ["--data", "digits", "--seeds", "0", "--alphas", "1.0", "--algorithms", "fedproto",
            "--table-only", "--out", str(out), "--md", str(md)]  # fmt: skip
    experiment.main(compare.EXPERIMENT, argv)
    text = md.read_text()
    assert "| `local` | 1 | " in text and "| `fedproto` | 1 | " in text
    assert "| `fedtgp` | 0 | not run yet" in text
    assert "--algorithms" not in text.split("Produced by", 1)[1].split("\n", 1)[0]


def test_the_overall_pick_is_best_on_both_in_most_settings_then_by_mean_rank() -> None:
    def run(alg: str, personal: float, glob: float) -> dict[str, object]:
        return {"spec": {"algorithm": alg}, "acc_personal": personal, "acc_global": glob}

    settings = {
        # a: best on both here; b: second on both; c: runs in one setting only (not ranked,
        # though it would win this one)
        ("digits", 0.1): [run("a", 0.9, 0.5), run("b", 0.8, 0.4), run("c", 0.99, 0.9)],
        # no one is best on both: b best personalised, a best global
        ("digits", 1.0): [run("a", 0.7, 0.6), run("b", 0.8, 0.5)],
        ("mnist5k", 0.1): [run("a", 0.1, 0.1), run("b", 0.2, 0.2)],  # b best on both
    }

    def rows() -> list[str]:
        lines = compare.overall_section(settings, partial=False)
        return [line for line in lines if line.startswith("| `")]

    # one win each and the same mean rank (a: 1,1,2,1,2,2; b: 2,2,1,2,1,1): by name
    assert rows() == ["| `a` | 1 of 3 | 1.5 |", "| `b` | 1 of 3 | 1.5 |"]
    settings[("digits", 1.0)][1] = run("b", 0.8, 0.7)  # b now best on both there too
    assert rows() == ["| `b` | 2 of 3 | 1.3 |", "| `a` | 1 of 3 | 1.7 |"]
    settings[("mnist5k", 1.0)] = [run("a", 0.9, 0.9), run("b", 0.1, 0.1)]  # a wins there
    settings[("mnist5k", 0.2)] = [run("a", 0.9, 0.9), run("b", 0.1, 0.1)]  # and there
    assert rows() == ["| `a` | 3 of 5 | 1.4 |", "| `b` | 2 of 5 | 1.6 |"]
    lines = compare.overall_section(settings, partial=True)
    assert lines[-2].endswith("`a` (provisional: some runs of the grid are not done yet).")
    assert "`c`" not in "\n".join(lines)
    # the demo is meant to run the pick: the page says when it does not
    assert "coordinator demo" not in compare.overall_section(settings, False, demo="a")[-2]
    assert "`coordinator demo` runs `b`" in compare.overall_section(settings, False, demo="b")[-2]


def test_a_call_for_one_dataset_or_seed_keeps_the_whole_grid_on_the_page(tmp_path: Path) -> None:
    import harness

    # a call for MNIST-5k alone rewrote docs/results/common.md without its digits tables
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    harness.save_results(out, [], [])
    argv = ["--data", "mnist5k", "--seeds", "1", "--algorithms", "local", "--table-only",
            "--out", str(out), "--md", str(md)]  # fmt: skip
    experiment.main(compare.EXPERIMENT, argv)
    text = md.read_text()
    for data in ("digits", "mnist5k"):
        for alpha in ("0.1", "1.0"):
            assert f"## {data}, Dir({alpha})" in text
    assert "seeds 0, 1, 2" in text
    assert "Produced by `python benchmarks/compare.py --jobs" in text  # the preset's own grid
    args = compare.whole_grid(compare.parse_args(["--quick", "--data", "mnist5k"]))
    assert args.data == ["digits", "mnist5k"] and args.seeds == [0]


def test_the_own_recipe_grid_is_digits_and_its_page_says_how_to_rerun_it() -> None:
    own = compare.parse_args(["--train", "own"])
    assert own.data == ["digits"] and compare.whole_grid(own).data == ["digits"]
    assert compare.command(own) == "python benchmarks/compare.py --train own --jobs 1 --threads 1"
    rerun = "\n".join(compare.rerun_text(own))
    assert "--train own --out benchmarks/results/compare_own.json" in rerun
    assert "x 1 dataset x 2 alphas x 3 seeds" in rerun
    common = compare.parse_args([])
    assert compare.whole_grid(common).data == ["digits", "mnist5k"]
    assert "x 2 datasets x 2 alphas x 3 seeds" in "\n".join(compare.rerun_text(common))
