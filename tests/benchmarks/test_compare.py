"""benchmarks/compare.py's planning: which runs exist, in which order, and how the page says so."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # its own imports

from benchmarks import compare


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
