"""Issue 19, probe 4: a task's training settings are bounded, so a fake task with
``local_epochs=100000`` is refused with a clear error instead of being executed."""

from __future__ import annotations

import pytest

from protocol.algorithms import TrainConfig, config_type
from protocol.algorithms.base import TRAIN_LIMITS
from protocol.errors import ConfigError


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("local_epochs", 100_000),
        ("batch_size", 1_000_000),
        ("lr", 1e6),
        ("momentum", 1.5),
        ("weight_decay", 10.0),
        ("grad_clip", 1e12),
    ],
)
def test_out_of_range_training_settings_are_refused_by_every_algorithm(
    key: str, value: float
) -> None:
    for name in ("fedproto", "fedavg", "fedvtc"):
        with pytest.raises(ConfigError, match=rf"task t1\.config: {key} must be in"):
            config_type(name).from_dict({key: value}, where="task t1.config")


def test_the_limits_admit_the_defaults_and_their_own_edges() -> None:
    edges = {k: hi for k, (_, hi) in TRAIN_LIMITS.items() if k != "momentum"}
    assert TrainConfig.from_dict(edges).local_epochs == TRAIN_LIMITS["local_epochs"][1]
    assert TrainConfig().local_epochs == 1


@pytest.mark.parametrize(
    ("algorithm", "key", "value"),
    [
        ("fedvtc", "synthetic_per_class", 10**7),
        ("fedvtc", "finetune_epochs", 100_000),
        ("velo", "cvae_epochs", 100_000),
        ("velo", "cvae_hidden", 10**8),
    ],
)
def test_an_algorithms_own_size_settings_are_bounded(algorithm: str, key: str, value: int) -> None:
    from protocol.algorithms import config_type

    with pytest.raises(ConfigError, match=key):
        config_type(algorithm).from_dict({key: value}, where="task t.config")
    config_type(algorithm).from_dict({})  # the defaults are inside the bounds
