"""benchmarks/privacy.py's planning and page: ``local`` once a seed without a budget, the
budget in each other run's config (FedKTL's with its ETF-sized features), epsilon 0 shown as DP
off."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # its own imports

import experiment
import privacy


def test_local_runs_once_a_seed_and_the_others_carry_their_budget() -> None:
    args = experiment.parse_args(privacy.EXPERIMENT, ["--seeds", "1", "--epsilons", "1", "0"])
    specs = privacy.plan(args)
    cells = [(s["method"], s["epsilon"]) for s in specs]
    assert cells.count(("local", 0.0)) == 1 and ("local", 1.0) not in cells
    for s in specs:
        dp = s["hyper"].get("dp_epsilon")
        assert dp == (s["epsilon"] or None)
    felo = next(s for s in specs if s["method"] == "felo" and s["epsilon"] == 1.0)
    assert felo["hyper"]["same_arch_avg"] is False  # else hyper.dp is refused


def test_fedktl_is_in_the_grid_with_its_budget_and_features_sized_for_its_etf() -> None:
    args = experiment.parse_args(privacy.EXPERIMENT, ["--seeds", "1", "--epsilons", "1", "0"])
    specs = {(s["method"], s["epsilon"]): s for s in privacy.plan(args)}
    # the grid runs each algorithm in the setting advised under DP
    assert {m for m, _ in specs} == {
        "local", "fedproto_count_head_clipped", "fedtgp_head_clipped", "felo", "fedktl",
    }  # fmt: skip
    ktl = specs[("fedktl", 1.0)]
    assert ktl["preset"] == "htfllib" and ktl["hyper"]["dp_epsilon"] == 1.0
    assert privacy.feature_dim(ktl) == 10  # K = the MNIST classes, as the reference tier's
    assert privacy.feature_dim(specs[("felo", 1.0)]) is None  # the family's own


def test_the_page_puts_each_method_under_its_budget() -> None:
    args = experiment.parse_args(privacy.EXPERIMENT, ["--seeds", "1", "--epsilons", "4", "0"])
    specs = privacy.plan(args)
    runs = [
        {"spec": s, "best_personal": 0.5 + s["epsilon"] / 100, "last_personal": 0.4,
         "last_global": 0.3}
        for s in specs
    ]  # fmt: skip
    page = privacy.tables(experiment.Results(args, specs, runs, []))
    assert "| method | ε = 4 | ε = ∞ (off) |" in page
    assert "| `fedproto_count_head_clipped` | 54.00 | 50.00 |" in page
    assert "| `local` | – | 50.00 |" in page
    assert "Provisional" not in page
    # a run outside the plan (a single-seed diagnostic arm) shows, and is not counted as planned
    extra = {**runs[1], "spec": {**specs[1], "method": "fedproto", "seed": 1}}
    page = privacy.tables(experiment.Results(args, specs, [extra, *runs[1:]], []))
    assert "| `fedproto` | 54.00 |" in page
    assert f"**Provisional**: {len(specs) - 1} of the {len(specs)} planned runs done." in page


def test_the_noise_table_gives_each_budgets_multiplier_and_signal_to_noise() -> None:
    import math
    import re

    from edge_agent.dp import noise_multiplier

    args = experiment.parse_args(privacy.EXPERIMENT, ["--seeds", "1", "--epsilons", "1", "8"])
    specs = privacy.plan(args)
    page = privacy.noise_table(experiment.Results(args, specs, [], []))
    row = r"^\|" + r" ([\d.]+) \|" * 5 + "$"
    rows = {
        float(m[1]): (float(m[2]), float(m[3]), float(m[4]), float(m[5]))
        for m in re.finditer(row, page, re.M)
    }
    assert sorted(rows) == [1.0, 8.0]
    n = float(re.search(r"n = ([\d.]+) training samples", page)[1])  # type: ignore[index]
    for eps, (z, one, _, _) in rows.items():
        exact = noise_multiplier(eps, 1e-5, args.rounds, 2)
        assert z == round(exact, 2)
        assert one == round(n / (exact * math.sqrt(512)), 3)  # htfl_cnn's 512-d features
    # more budget, less noise; the server's mean beats one device's, by count beats plain
    assert rows[8.0][1] > rows[1.0][1] and rows[8.0][3] > rows[8.0][2] > rows[8.0][1]
