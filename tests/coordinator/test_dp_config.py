"""``hyper.dp``: a typed section of the algorithm's config, validated like the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.config import load_config
from protocol.errors import ConfigError


def test_a_dp_section_and_dotted_overrides_become_the_configs_dp_fields(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('[run]\nalgorithm = "fedproto"\nrounds = 7\n[hyper.dp]\nepsilon = 4.0\n')
    cfg = load_config(toml, ["hyper.dp.clip=0.5"]).algorithm_config()
    assert (cfg.dp_epsilon, cfg.dp_clip, cfg.dp_releases) == (4.0, 0.5, 7)  # type: ignore[attr-defined]
    task = cfg.task_config()
    assert task["dp_epsilon"] == 4.0 and task["dp_releases"] == 7
    off = load_config(None, [], algorithm="fedproto").algorithm_config()
    assert not [k for k in off.task_config() if k.startswith("dp_")]
    assert "dp_epsilon" in off.to_dict()  # the full config still shows every setting


@pytest.mark.parametrize(
    ("algorithm", "extra", "why"),
    [
        ("fedvtc", [], "learned sigma and its generator"),
        ("fedkd", [], "batch's mean loss"),
        ("fedtype", [], "conformal sets"),
        ("fedgen", [], "neither per-class sums"),
        ("velo", ["hyper.upload_samples=4"], "upload_samples"),
    ],
)
def test_dp_is_refused_where_it_would_not_cover_the_replies(
    algorithm: str, extra: list[str], why: str
) -> None:
    with pytest.raises(ConfigError, match=why):
        load_config(None, ["hyper.dp.epsilon=1", *extra], algorithm=algorithm).algorithm_config()


@pytest.mark.parametrize(
    "bad",
    [
        "hyper.dp.epsilon=-1",
        "hyper.dp.delta=1.0",
        "hyper.dp.clip=0",
        "hyper.dp.releases=-1",
        "hyper.dp.share=0",
        "hyper.dp.share=1",
    ],
)
def test_out_of_range_dp_settings_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="dp"):
        load_config(None, ["hyper.dp.epsilon=1", bad], algorithm="fedproto").algorithm_config()


@pytest.mark.parametrize(
    "algorithm",
    [
        "fedproto",
        "fedtgp",
        "fedgh",
        "fd",
        "fedhe",
        "fedktl",
        "fedavg",
        "lg_fedavg",
        "fml",
        "felo",
        "velo",
        "ccvr",
    ],
)
def test_dp_is_accepted_by_the_algorithms_whose_replies_it_covers(algorithm: str) -> None:
    cfg = load_config(None, ["hyper.dp.epsilon=1"], algorithm=algorithm).algorithm_config()
    assert cfg.task_config()["dp_epsilon"] == 1.0
    assert "dp_share" not in cfg.task_config()  # at its default, it costs no bytes


def test_the_share_travels_when_set_and_splits_the_budget_where_both_mechanisms_run() -> None:
    cfg = load_config(None, ["hyper.dp.epsilon=4", "hyper.dp.share=0.25"], algorithm="ccvr")
    algo = cfg.algorithm_config()
    assert algo.task_config()["dp_share"] == 0.25
    assert algo.dp_statistics_epsilon() == 1.0  # type: ignore[attr-defined]
    alone = load_config(None, ["hyper.dp.epsilon=4", "hyper.dp.share=0.25"], algorithm="fd")
    assert alone.algorithm_config().dp_statistics_epsilon() == 4.0  # type: ignore[attr-defined]
