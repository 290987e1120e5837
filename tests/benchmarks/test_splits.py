"""The committed HtFLlib-style split files: their command rewrites them; they hold its setting."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from coordinator.cli import main

SPLITS = Path(__file__).resolve().parents[2] / "benchmarks" / "splits"
FILES = {"mnist5k_dir0.1_c20_s1.npz": 0.1, "mnist5k_dir1.0_c20_s1.npz": 1.0}


def _arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {key: data[key] for key in data.files}


@pytest.mark.parametrize(("name", "alpha"), sorted(FILES.items()))
def test_split_file_is_what_its_command_writes(name: str, alpha: float, tmp_path: Path) -> None:
    out = tmp_path / name
    argv = ["partition", "--data", "mnist5k", "--clients", "20", "--alpha", str(alpha)]
    argv += ["--seed", "1", "--test-fraction", "0.25", "--global-test-size", "0"]
    assert main([*argv, "--min-size", "40", "--out", str(out)]) == 0
    want, got = _arrays(SPLITS / name), _arrays(out)
    assert sorted(want) == sorted(got)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.parametrize(("name", "alpha"), sorted(FILES.items()))
def test_split_file_has_htfllib_setting(name: str, alpha: float) -> None:
    arrays = _arrays(SPLITS / name)
    train = [arrays[f"train_idx_{k}"] for k in range(20)]
    test = [arrays[f"test_idx_{k}"] for k in range(20)]
    assert "train_idx_20" not in arrays and arrays["global_test_idx"].size == 0
    every = np.concatenate([*train, *test])
    assert np.array_equal(np.sort(every), np.arange(5000))  # all samples, each once
    for tr, te in zip(train, test, strict=True):
        assert len(tr) + len(te) >= 40
        assert abs(len(te) - 0.25 * (len(tr) + len(te))) <= 0.5
    spec = json.loads(str(arrays["spec_json"].item()))["spec"]
    assert spec["alpha"] == alpha and spec["scheme"] == "dirichlet" and spec["seed"] == 1
