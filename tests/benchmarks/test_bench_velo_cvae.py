"""Velo's CVAE cost projection: the table grows by a round's uploads until the per-class cap."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # its own imports

import bench_velo_cvae as bench

SPLIT = bench.ROOT / "benchmarks/splits/mnist5k_dir1.0_c20_s1.npz"


def test_the_table_grows_by_each_rounds_uploads_until_the_cap() -> None:
    added = np.array([3, 1])
    # a cap of 4 a class; the table of round 1 holds 3 + 1, round 2 4 + 2, round 3 4 + 3
    assert bench.run_seconds(added, cap=4, rounds=3, epochs=10, rate=100.0) == pytest.approx(
        10 * (4 + 6 + 7) / 100
    )


def test_a_round_adds_one_mean_per_held_class_or_up_to_the_samples_a_class() -> None:
    means = bench.per_round_entries(SPLIT, 0, 10)
    samples = bench.per_round_entries(SPLIT, 8, 10)
    assert means.sum() <= 20 * 10 and (means <= 20).all()  # one a client holding the class
    assert (means <= samples).all() and (samples <= 8 * means).all()
    assert samples.sum() > means.sum()
