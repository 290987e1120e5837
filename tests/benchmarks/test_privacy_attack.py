"""benchmarks/privacy_attack.py's attacks on synthetic uploads: exact without differential
privacy, chance under overwhelming noise, each release noised as one release of the run."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # its own imports

import experiment
import privacy_attack

from edge_agent.class_stats import ClassMeans
from edge_agent.dp import noise_multiplier

DIM = 256
CPU = torch.device("cpu")


def _stats(features: torch.Tensor, labels: torch.Tensor, clip: float) -> ClassMeans:
    """The class sums a device would release (ClassMeans clips as it adds)."""
    stats = ClassMeans(2, DIM, CPU, clip)
    stats.add(features, labels)
    return stats


def _attack(epsilon: float, members: torch.Tensor, others: torch.Tensor) -> dict[str, float]:
    """The class-0 attack on one run of 3 releases of ``members``' sums."""
    settings = privacy_attack.dp_settings(epsilon, 1e-5, 1.0, 50)
    clip = 0.0 if settings is None else settings.clip
    labels = torch.zeros(len(members), dtype=torch.long)
    stats = _stats(members, labels, clip)
    held = [len(members), 0]
    run = [
        r[0].means(torch.tensor([0]))[0].numpy()
        for r in privacy_attack.released([stats], held, settings, 3)
    ]

    def feats(x: torch.Tensor) -> np.ndarray:
        return privacy_attack._clipped(x.numpy(), clip)

    public = feats(torch.randn(64, DIM))
    result = privacy_attack.class_attack(feats(members), feats(others), public, run)
    return {k: v for k, v in result.items() if not k.startswith("z_")}


def test_without_dp_a_one_sample_class_is_recovered() -> None:
    gen = torch.Generator().manual_seed(0)
    member, others = torch.randn(1, DIM, generator=gen), torch.randn(1, DIM, generator=gen)
    result = _attack(0.0, member, others)
    assert result["auc_distance_one"] == 1.0
    assert result["nearest_one"] == 1.0


def test_without_dp_the_tracing_statistic_separates_a_class() -> None:
    gen = torch.Generator().manual_seed(1)
    members, others = torch.randn(10, DIM, generator=gen), torch.randn(10, DIM, generator=gen)
    assert _attack(0.0, members, others)["auc_inner_one"] > 0.95


def test_overwhelming_noise_leaves_the_attack_at_chance() -> None:
    gen = torch.Generator().manual_seed(2)
    aucs = []
    for _ in range(50):
        members, others = torch.randn(10, DIM, generator=gen), torch.randn(10, DIM, generator=gen)
        aucs.append(_attack(0.05, members, others)["auc_inner_one"])
    assert abs(float(np.mean(aucs)) - 0.5) < 0.1


def test_each_release_carries_one_release_of_the_runs_noise() -> None:
    settings = privacy_attack.dp_settings(4.0, 1e-5, 1.0, 50)
    assert settings is not None
    stats = ClassMeans(2, DIM, CPU, settings.clip)
    stats.counts += 100
    (first,), (second,) = privacy_attack.released([stats], [100, 100], settings, 2)
    z = noise_multiplier(4.0, 1e-5, 50, 2)  # one table of sums and the counts a release
    for release in (first, second):
        sd = float(release.sums.std())
        assert abs(sd / (z * settings.clip) - 1) < 0.1
    assert not torch.equal(first.sums, second.sums)  # independent draws
    assert float(stats.sums.abs().max()) == 0.0  # the device's own sums are untouched


def test_the_histogram_is_exact_without_dp_and_noised_with_it() -> None:
    counts = [30, 0, 12, 5, 1]
    off = privacy_attack.histogram_run(counts, 1, None, 5)
    assert off == {"one": 0.0, "mean": 0.0, "max": 0.0}
    settings = privacy_attack.dp_settings(1.0, 1e-5, 1.0, 50)
    noisy = [privacy_attack.histogram_run(counts, 1, settings, 5)["one"] for _ in range(5)]
    assert max(noisy) > 0.0


def test_tvd_and_auc() -> None:
    truth = np.array([3.0, 1.0, 0.0])
    assert privacy_attack.tvd(truth * 7, truth) == 0.0
    assert privacy_attack.tvd(np.array([0.0, 0.0, 5.0]), truth) == 1.0
    assert privacy_attack.auc(np.array([2.0, 3.0]), np.array([0.0, 1.0])) == 1.0
    assert privacy_attack.auc(np.array([1.0]), np.array([1.0])) == 0.5
    assert privacy_attack.tpr_at(np.array([5.0, 0.5]), np.arange(100.0) / 100) == 0.5


def test_the_plan_attacks_each_device_once_a_seed_and_the_histogram_once() -> None:
    args = experiment.parse_args(
        privacy_attack.EXPERIMENT, ["--seeds", "1", "2", "--devices", "0", "5"]
    )
    specs = privacy_attack.plan(args)
    assert [s["method"] for s in specs].count("histogram") == 1
    cells = [(s["seed"], s["device"]) for s in specs if s["method"] == "membership"]
    assert sorted(cells) == [(1, 0), (1, 5), (2, 0), (2, 5)]


def test_the_page_groups_classes_by_size_and_counts_exact_histograms() -> None:
    args = experiment.parse_args(
        privacy_attack.EXPERIMENT,
        ["--seeds", "1", "--devices", "0", "--epsilons", "1", "0", "--out", "/nonexistent.json"],
    )
    specs = privacy_attack.plan(args)
    metrics = ("auc_inner", "auc_distance", "nearest")

    def cell(epsilon: float, n: int, value: float) -> dict[str, float]:
        per = {f"{k}_{w}": value for k in metrics for w in ("one", "run")}
        return {"epsilon": epsilon, "class": n, "n": n, **per}

    member = {
        "spec": next(s for s in specs if s["method"] == "membership"),
        "model": "hcnn1",
        "acc_train": 1.0,
        "acc_test": 0.9,
        "cells": [cell(0.0, 1, 1.0), cell(0.0, 40, 0.7), cell(1.0, 1, 0.5), cell(1.0, 40, 0.5)],
        "tpr_inner_large": {"0.0": {"one": 0.2, "run": 0.2}, "1.0": {"one": 0.01, "run": 0.01}},
    }
    hist = {
        "spec": next(s for s in specs if s["method"] == "histogram"),
        "cells": [
            {"epsilon": 1.0, "sender": "fd", "client": k, "one": 0.2, "mean": 0.1, "max": m}
            for k, m in enumerate((0.0, 0.0, 0.05))
        ],
    }
    page = privacy_attack.tables(experiment.Results(args, specs, [member, hist], []))
    assert "| one | ∞ (off) | n = 1 (1) | 1.000 | 1.000 | 1.000 | – |" in page
    assert "| one | ∞ (off) | n > 5 (1) | 0.700 | 0.700 | 0.700 | 0.200 |" in page
    assert "| one | 1 | 2 ≤ n ≤ 5 (0) | – | – | – | – |" in page
    assert "| fd | 1 | 0.200 ± 0.000 | 0.100 ± 0.000 | 0.017 ± 0.072 | 2/3 |" in page
