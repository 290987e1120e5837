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
    assert {"fedproto", "fedtgp", "felo", "fedktl"} <= {m for m, _ in specs}
    ktl = specs[("fedktl", 1.0)]
    assert ktl["preset"] == "htfllib" and ktl["hyper"]["dp_epsilon"] == 1.0
    assert privacy.feature_dim(ktl) == 10  # K = the MNIST classes, as the reference tier's
    assert privacy.feature_dim(specs[("fedproto", 1.0)]) is None  # the family's own


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
    assert "| `fedproto` | 54.00 | 50.00 |" in page
    assert "| `local` | – | 50.00 |" in page
    assert "Provisional" not in page
