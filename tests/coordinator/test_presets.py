"""The demo's preset (``coordinator/presets/demo.toml``): the run config and feature size each
algorithm gets are the ones the demo's former in-code defaults gave it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from coordinator.cli import build_parser
from coordinator.commands.demo import demo_config, demo_feature_dim, demo_preset
from coordinator.config import RunConfig, load_config

# the demo's former defaults, spelled out: 8 rounds on mnist5k, and per algorithm the
# ``--set`` overrides it put before the user's and its agents' feature size
TRAINING = ["hyper.local_epochs=2", "hyper.lr=0.05"]
FORMER = {
    "fedktl": (TRAINING, 10),
    "felo": ([*TRAINING, "hyper.optimizer=sgd"], 980),
    "fedvtc": (
        [
            *TRAINING,
            "hyper.synthetic_per_class=50",
            "hyper.model_tc_weight=0.1",
            "hyper.generator_bn_recalibrate=true",
            "hyper.sd_init=0.1",
            "hyper.sd_max=0.1",
        ],
        980,
    ),
    "fedtgp": ([], 980),  # no arm: its config's own defaults
}


def demo(tmp_path: Path, *argv: str) -> tuple[RunConfig, argparse.Namespace]:
    args = build_parser().parse_args(["demo", "--run-dir", str(tmp_path / "d"), *argv])
    return demo_config(args), args


@pytest.mark.parametrize("algorithm", sorted(FORMER))
def test_each_algorithm_runs_with_the_demos_former_settings(tmp_path: Path, algorithm: str) -> None:
    overrides, feature_dim = FORMER[algorithm]
    expected = load_config(
        None, overrides, algorithm=algorithm, rounds=8, run_dir=str(tmp_path / "d")
    ).replace(run_id="d")
    cfg, args = demo(tmp_path, "--algorithm", algorithm)
    assert cfg == expected
    assert args.data == "mnist5k"
    assert demo_feature_dim(cfg, "mnist5k", None) == feature_dim


def test_the_demos_typed_values_and_the_users_set_wins(tmp_path: Path) -> None:
    cfg, _ = demo(tmp_path)
    assert (cfg.algorithm, cfg.rounds) == ("fedproto", 8)
    assert cfg.hyper["lr"] == 0.05 and cfg.hyper["local_epochs"] == 2
    cfg, _ = demo(tmp_path, "--algorithm", "fedvtc", "--set", "hyper.lr=0.1")
    assert cfg.hyper["lr"] == 0.1
    assert cfg.hyper["generator_bn_recalibrate"] is True


def test_every_demo_arm_is_named_after_its_algorithm() -> None:
    # the demo looks an algorithm's arm up by name
    arms = demo_preset().arms
    assert arms and all(name == arm.algorithm for name, arm in arms.items())
