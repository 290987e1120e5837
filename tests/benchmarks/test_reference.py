"""The reference tier's reductions and page: both metrics' best round and last-10 mean, the
personalised one weighted by each client's test split, paired differences from ``local``."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # its own imports

import experiment
import reference

Record = dict[str, Any]


def step(round_: int, accs: list[float], glob: list[float], phase: str = "train") -> Record:
    agents = {
        f"agent{k}": {"acc_local": a, "acc_global": g, "num_samples": 1}
        for k, (a, g) in enumerate(zip(accs, glob, strict=True))
    }
    return {"phase": phase, "round": round_, "agents": agents, "duration_s": 2.0}


def test_summarize_weights_by_test_size_and_takes_best_and_last_rounds() -> None:
    # agent1 holds three times agent0's test samples: its accuracy weighs three times as much
    steps = [step(r, [0.0, r / 20], [0.5, 0.5 + r / 100]) for r in range(1, 21)]
    steps[14] = step(15, [1.0, 1.0], [0.9, 0.9])  # the best round on both metrics
    steps.append(step(21, [0.0, 0.0], [0.0, 0.0], phase="final"))  # not a training round
    out = reference.summarize(steps, sizes=[10, 30])
    assert out["rounds_done"] == 20
    assert out["best_personal"] == pytest.approx(1.0) and out["best_round_personal"] == 15
    assert out["best_global"] == pytest.approx(0.9) and out["best_round_global"] == 15
    last = [0.75 * r / 20 for r in range(11, 21) if r != 15] + [1.0]
    assert out["last_personal"] == pytest.approx(sum(last) / 10)
    assert out["curve_personal"][0] == pytest.approx(0.75 / 20)


def test_a_sparse_global_curve_is_summarised_over_its_scored_rounds() -> None:
    steps = [step(r, [0.5, 0.5], [r / 100, r / 100]) for r in range(1, 21)]
    for s in steps:  # the global set scored every 5th round only
        if s["round"] % 5:
            for agent in s["agents"].values():
                del agent["acc_global"]
    out = reference.summarize(steps, sizes=[1, 1])
    assert out["best_global"] == pytest.approx(0.20) and out["best_round_global"] == 20
    assert out["last_global"] == pytest.approx((0.15 + 0.20) / 2)  # rounds 15 and 20


def htfllib_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, algorithm: str, rounds: range
) -> None:
    """One HtFLlib run of ``algorithm`` on the Dir 1.0 split, accuracy 0.5 + round / 100."""
    lines = ["algorithm\trun\tround\taccuracy\tseconds"]
    lines += [f"{algorithm}\t0\t{r}\t{0.5 + r / 100:.2f}\t1.0" for r in rounds]
    (tmp_path / "htfl_1.0.tsv").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(reference, "ROOT", tmp_path)
    monkeypatch.setitem(reference.HTFLLIB, "runs", "htfl_{alpha}.tsv")


def run(method: str, seed: int, best: float, last: float) -> Record:
    spec = {"method": method, "algorithm": method, "alpha": 1.0, "seed": seed}
    return {
        "spec": spec,
        "rounds_done": 40 + seed,
        "s_per_round": 3.0,
        "best_personal": best,
        "last_personal": last,
        "best_global": best / 2,
        "last_global": last / 2,
    }


def test_tables_show_both_summaries_and_paired_differences_from_local() -> None:
    runs = [run("local", s, 0.80 + s / 100, 0.78) for s in (1, 2, 3)]
    runs += [run("fedproto", s, 0.82 + s / 100, 0.81) for s in (1, 2, 3)]
    args = experiment.parse_args(reference.EXPERIMENT, [])
    text = reference.tables(experiment.Results(args, [], runs, []))
    assert text.startswith("# The reference tier") and "`benchmarks/results/reference.json`" in text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("|")}
    assert "82.00 ± 2.48" in rows["`local`"]  # 80+s over seeds 1-3: mean 82, t(2) 4.30 sd 1
    assert rows["`local`"].split("|")[3].strip() == "41–43"  # rounds run, min–max
    diff = rows["`fedproto` − `local`"]
    assert "+2.00" in diff and "+3.00" in diff  # best +2 points, last-10 +3 points


def test_a_seed_method_is_also_compared_with_its_own_control_on_the_seeds_both_ran() -> None:
    runs = [run("local", s, 0.80, 0.80) for s in (1, 2, 3)]
    runs += [run("fedktl", s, 0.85 + s / 100, 0.84) for s in (1, 2, 3)]
    runs += [run("fedktl_mu0", s, 0.86, 0.86) for s in (1, 2)]  # seed 3 not run yet
    args = experiment.parse_args(reference.EXPERIMENT, [])
    text = reference.tables(experiment.Results(args, [], runs, []))
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("|")}
    control = rows["`fedktl` − `fedktl_mu0`"].split("|")
    assert control[2].strip() == "2"  # the seeds both ran
    assert control[3].strip().startswith("+0.50") and control[4].strip().startswith("-2.00")
    assert "`fedktl_mu0` − `local`" in rows  # the control is a row of its own too


def test_plan_runs_a_whole_seed_before_the_next() -> None:
    args = experiment.parse_args(reference.EXPERIMENT, ["--seeds", "1", "2"])
    specs = experiment.plan(reference.EXPERIMENT, args)
    seeds = [s["seed"] for s in specs]
    assert seeds == sorted(seeds) and len(specs) == 2 * len(args.alphas) * len(args.methods)
    by = {s["method"]: s for s in specs}
    assert by["fedproto"]["preset"] == "htfllib"
    assert all(s["split"].startswith("benchmarks/splits/") for s in specs)


def test_htfllib_runs_are_summarised_on_trained_rounds_beside_the_matching_arm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # HtFLlib's round 0 is the untrained start: a high value there must not count as its best
    lines = ["algorithm\trun\tround\taccuracy\tseconds", "FedProto\t0\t0\t0.99\t"]
    lines += [f"FedProto\t0\t{r}\t{0.5 + r / 100:.2f}\t1.0" for r in range(1, 21)]
    (tmp_path / "htfl_1.0.tsv").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(reference, "ROOT", tmp_path)
    monkeypatch.setitem(reference.HTFLLIB, "runs", "htfl_{alpha}.tsv")
    assert reference.curve_summary(reference.htfllib_curves(1.0)["FedProto"][0]) == (
        pytest.approx(0.70),
        pytest.approx(statistics.fmean(0.5 + r / 100 for r in range(11, 21))),
        20,
    )
    by = {"fedproto": {1: run("fedproto", 1, 0.72, 0.70)}}
    rows = [line for line in reference.parity(1.0, by) if line.startswith("| FedProto")]
    assert len(rows) == 1 and rows[0].endswith("| +2.00 |")  # 72.00 (ours) - 70.00 (HtFLlib)
    assert reference.parity(0.1, by) == []  # no HtFLlib file for that split: no section


def test_an_htfllib_algorithm_matched_by_two_arms_gets_a_parity_row_for_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    htfllib_run(tmp_path, monkeypatch, "FML", range(1, 21))
    monkeypatch.setitem(reference.HTFLLIB, "arms", {"FML": ["fml", "fml_htfllib"]})
    by = {
        "fml": {1: run("fml", 1, 0.69, 0.6)},
        "fml_htfllib": {1: run("fml_htfllib", 1, 0.71, 0.6)},
    }
    rows = [line for line in reference.parity(1.0, by) if line.startswith("| FML")]
    assert [r.split("|")[2].strip() for r in rows] == ["`fml`", "`fml_htfllib`"]
    assert rows[0].endswith("| -1.00 |") and rows[1].endswith("| +1.00 |")
    text = reference.glance(1.0, by, htfllib=True)
    glance = {line.split("|")[1].strip(): line for line in text if "| `" in line}
    assert glance["`fml`"].endswith("| 70.00 |") and glance["`fml_htfllib`"].endswith("| 70.00 |")


def test_the_edge_tier_is_the_same_grid_on_the_tiny_family_with_its_own_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = experiment.parse_args(reference.EXPERIMENT, ["--preset", "edge", "--seeds", "1"])
    assert args.family == "tiny" and str(args.out).endswith("edge_tier.json")
    specs = experiment.plan(reference.EXPERIMENT, args)
    assert {s["family"] for s in specs} == {"tiny"} and specs[0]["preset"] in ("htfllib", "")
    # HtFLlib ran its own networks: its rows are no parity check for this tier
    lines = ["algorithm\trun\tround\taccuracy\tseconds", "FedProto\t0\t1\t0.5\t1.0"]
    (tmp_path / "htfl_1.0.tsv").write_text("\n".join(lines) + "\n")
    monkeypatch.setitem(reference.HTFLLIB, "runs", str(tmp_path / "htfl_{alpha}.tsv"))
    runs = [run("local", 1, 0.8, 0.8), run("fedproto", 1, 0.82, 0.81)]
    text = reference.tables(experiment.Results(args, [], runs, []))
    assert text.startswith("# The edge tier") and "`benchmarks/results/edge_tier.json`" in text
    assert "HtFLlib itself" not in text
    args.family = "htfl_cnn"
    assert "HtFLlib itself" in reference.tables(experiment.Results(args, [], runs, []))


def test_the_long_preset_is_the_reference_grid_with_a_higher_cap_and_its_own_files() -> None:
    args = experiment.parse_args(reference.EXPERIMENT, ["--preset", "long", "--seeds", "1"])
    base = experiment.parse_args(reference.EXPERIMENT, ["--seeds", "1"])
    assert args.rounds > base.rounds and args.patience == base.patience
    assert args.family == base.family and str(args.out).endswith("reference_long.json")
    spec = reference.run_spec(args, "local", 1.0, 1)
    assert spec == {**reference.run_spec(base, "local", 1.0, 1), "rounds": args.rounds}
    runs = [run("local", s, 0.8, 0.8) for s in (1, 2)]
    for r, past in zip(runs, (0.02, 0.0), strict=True):  # seed 2 stopped within the 100
        curve = [0.8] * 100 + [0.8 + past] * (20 if past else 0)
        r["spec"] |= {"rounds": args.rounds, "patience": args.patience}
        r |= {"curve_personal": curve, "rounds_done": len(curve), "best_personal": max(curve)}
        r["best_round_personal"] = curve.index(max(curve)) + 1
    text = reference.tables(experiment.Results(args, [], runs, []))
    assert text.startswith("# The reference tier, trained longer")
    assert f"round cap ({args.rounds} rounds)" in text and "--preset long" in text
    # what the rounds past the tier's cap added, within each run: +2 and 0 points
    assert (
        "| `local` | 2 | 1 | 80.00 ± 0.00 | 81.00 ± 12.71 | +1.00 [-11.71, +13.71] "
        "| 1: +2.00 (best r101 of 120) · 2: +0.00 (best r1 of 100) |"
    ) in text
    for r in runs:
        r["spec"]["rounds"] = base.rounds  # the tier's own runs: nothing past its cap
    assert "Past the tier's cap" not in reference.tables(experiment.Results(base, [], runs, []))


def test_the_edge_tier_gives_its_family_one_feature_size_the_reference_tier_none() -> None:
    # the tiny family's networks differ in their own feature size (64 to 3136): a prototype
    # method's replies of the other sizes would be refused and the run would miss its quorum
    edge = experiment.parse_args(reference.EXPERIMENT, ["--preset", "edge"])
    assert reference.run_spec(edge, "fedproto", 1.0, 1)["feature_dim"] == 64
    ref = experiment.parse_args(reference.EXPERIMENT, [])
    assert "feature_dim" not in reference.run_spec(ref, "fedproto", 1.0, 1)  # identities kept


def test_a_final_phase_is_summarised_before_after_and_against_its_noise_control() -> None:
    steps = [step(r, [0.5, 0.5], [0.4, 0.4]) for r in range(1, 4)]
    final = step(4, [0.6, 0.8], [0.5, 0.7], phase="final")
    for k, agent in enumerate(final["agents"].values()):
        agent.update(acc_local_before_ft=0.5, acc_global_before_ft=0.4 + k / 10)
        agent.update(acc_local_noise_control=0.3, acc_global_noise_control=0.2)
        agent["num_samples"] = 5000  # synthetic samples: not the weights
    out = reference.summarize([*steps, final], sizes=[10, 30])
    assert out["final_personal"] == pytest.approx(0.75)  # (10 * 0.6 + 30 * 0.8) / 40
    assert out["final_global"] == pytest.approx(0.6)  # the mean over agents
    assert out["before_ft_global"] == pytest.approx(0.45)
    assert out["noise_control_personal"] == pytest.approx(0.3)
    assert "final_personal" not in reference.summarize(steps, sizes=[10, 30])


def test_the_final_phase_table_pairs_after_with_before_noise_and_local() -> None:
    runs = [run("local", s, 0.80, 0.78) for s in (1, 2)]
    for s in (1, 2):
        r = run("fedvtc", s, 0.40, 0.38)
        r.update(final_personal=0.50, final_global=0.30, before_ft_personal=0.38)
        r.update(before_ft_global=0.20, noise_control_personal=0.30, noise_control_global=0.10)
        runs.append(r)
    combo = run("fedvtc_combo", 1, 0.41, 0.39)
    combo.update(final_personal=0.70, final_global=0.65, before_ft_personal=0.41)
    runs.append(combo)
    plain = run("fedgen", 1, 0.45, 0.44)  # its last step scores the model: no final phase
    plain.update(final_personal=0.45, final_global=0.30)
    runs.append(plain)
    args = experiment.parse_args(reference.EXPERIMENT, [])
    text = reference.tables(experiment.Results(args, [], runs, []))
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("|")}
    # the variant against the paper's setting, after the final phase, on the seed both ran
    assert rows["`fedvtc_combo`: after − `fedvtc` after"].split("|")[2:5] == [
        " 1 ",
        " +20.00 ",
        " +35.00 ",
    ]
    assert "`fedvtc_combo` − `fedvtc`" in rows  # and in training, in the main table
    assert rows["`fedvtc`: after − before"].split("|")[3].strip().startswith("+12.00")
    assert rows["`fedvtc`: after − noise control"].split("|")[4].strip().startswith("+20.00")
    assert rows["`fedvtc`: after − `local` last 10"].split("|")[3].strip().startswith("-28.00")
    assert "`local`: after" not in text  # no final phase, no row
    assert "`fedgen`: after" not in text and "| `fedgen` | 1 | – |" not in text


def test_the_glance_table_puts_each_figure_beside_its_difference_and_htfllib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    htfllib_run(tmp_path, monkeypatch, "FedProto", range(0, 21))
    by = {
        "local": {s: run("local", s, 0.80 + s / 100, 0.78) for s in (1, 2, 3)},
        "fedproto": {s: run("fedproto", s, 0.82 + s / 100, 0.81) for s in (1, 2, 3)},
    }
    text = reference.glance(1.0, by, htfllib=True)
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in text if "| `" in line}
    assert [c.strip() for c in rows["`local`"]] == [
        "3",
        "82.00 ± 2.48",
        "–",
        "39.00 ± 0.00",
        "–",
        "–",
    ]
    cells = [c.strip() for c in rows["`fedproto`"]]
    assert cells[2].startswith("+2.00") and cells[4].startswith("+1.50")  # best; global last 10
    assert cells[5] == "70.00"  # HtFLlib's FedProto, its best trained round
    no_htfllib = reference.glance(1.0, by, htfllib=False)
    assert all(line.count("|") == 7 for line in no_htfllib if line.startswith("|"))
