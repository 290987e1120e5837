"""A task's training settings are bounded, so a fake task with
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


# docs/concepts/security.md item 7: every algorithm's own sizes, epochs and counts are bounded, so
# a task
# (or a run config) asking for more is a ConfigError naming the key, never executed
@pytest.mark.parametrize(
    ("algorithm", "key", "value"),
    [
        ("fedktl", "server_epochs", 100_000),
        ("fedktl", "server_batch_size", 10**6),
        ("fedktl", "feature_dim", 10**6),
        ("fedktl", "etf_dim", 10**6),
        ("fedktl", "latent_dim", 10**6),
        ("fedktl", "cppn_w_dim", 10**6),
        ("fedktl", "cppn_channels", 64),
        ("fedktl", "cppn_resolution", 100_000),
        ("fedtype", "raps_k_reg", 10**6),
        ("fedtype", "top_k", 10**6),
        ("fedtype", "platt_iters", 10**7),
        ("fedtype", "platt_batch", 10**6),
        ("fedtype", "local_epochs", 100_000),
        ("fedtgp", "server_epochs", 100_000),
        ("fedtgp", "server_batch_size", 10**6),
        ("fedtgp", "tgp_hidden_dim", 10**6),
        ("fedgh", "server_epochs", 100_000),
        ("fedgh", "server_batch_size", 10**6),
        ("fedgen", "noise_dim", 10**6),
        ("fedgen", "hidden_dim", 10**6),
        ("fedgen", "server_steps", 10**6),
        ("fedgen", "server_batch_size", 10**6),
        ("ccvr", "virtual_per_class", 10**6),
        ("ccvr", "calib_epochs", 100_000),
        ("ccvr", "calib_batch_size", 10**6),
        ("felo", "history_cap", 10**7),
        ("velo", "history_cap", 10**7),
        ("fd", "local_epochs", 100_000),
        ("lg_fedavg", "batch_size", 10**6),
        ("fml", "local_epochs", 100_000),
        ("fedkd", "local_epochs", 100_000),
    ],
)
def test_every_algorithms_sizes_are_bounded(algorithm: str, key: str, value: int) -> None:
    with pytest.raises(ConfigError, match=rf"task t\.config: {key} must be in \["):
        config_type(algorithm).from_dict({key: value}, where="task t.config")


@pytest.mark.parametrize(
    "algorithm",
    [
        *("fedktl", "fedtype", "fedtgp", "fedgh", "fedgen", "ccvr", "felo", "velo", "fedhe"),
        *("fd", "lg_fedavg", "fml", "fedkd", "fedvtc", "fedavg", "fedproto", "local"),
    ],
)
def test_the_defaults_and_the_upper_edges_are_accepted(algorithm: str) -> None:
    cls = config_type(algorithm)
    assert issubclass(cls, TrainConfig)
    defaults = cls()
    # each bounded key at its upper edge alone (the other settings' own checks still hold)
    for key, (_, hi) in cls.LIMITS.items():
        value = type(getattr(defaults, key))(hi)
        assert getattr(cls.from_dict({key: value}), key) == value
