"""Run config: TOML + overrides, unknown keys and wrong types are errors."""

from pathlib import Path

import pytest

from coordinator.config import load_config, parse_override, preset_differences
from protocol.errors import ConfigError


def test_toml_and_overrides(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "run.toml"
    path.write_text('[run]\nalgorithm = "fedproto"\nrounds = 3\n[hyper]\nlr = 0.05\n')
    # Execute
    cfg = load_config(path, ["run.rounds=7", "hyper.proto_weight=0.5"], seed=4)
    # Assert
    assert (cfg.rounds, cfg.seed) == (7, 4)
    hyper = cfg.algorithm_config().to_dict()
    assert hyper["lr"] == 0.05 and hyper["proto_weight"] == 0.5


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[run]\nround = 3\n", "unknown key"),
        ('[run]\nrounds = "three"\n', "expected int"),
        ('[hyper]\nlr = "fast"\n', "hyper.lr: expected float, got str 'fast'"),
        ("[hyper]\nlr = nan\n", "hyper.lr: expected a finite float, got float nan"),
        ("[run]\ndeadline_s = inf\n", "run.deadline_s: expected a finite float, got float inf"),
        ('[hyper]\noptimizer = "rmsprop"\n', r"hyper.optimizer: expected one of \['sgd', 'adam'\]"),
        ("[hyper]\nlearning_rate = 0.1\n", "unknown key"),
        ("[other]\nx = 1\n", "unknown section"),
        ('[run]\nalgorithm = "fedmagic"\n', "unknown algorithm"),
        ("[run\n", "invalid TOML"),
    ],
)
def test_bad_config_is_rejected(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(path)


def test_missing_file_and_bad_override(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=r"run\.KEY=VALUE"):
        parse_override("rounds=3")
    assert parse_override("hyper.optimizer=adam") == ("hyper", "optimizer", "adam")


def test_the_embedded_broker_listens_on_loopback_unless_told_otherwise() -> None:
    # an unauthenticated embedded broker bound to 0.0.0.0 would serve anyone on the network
    import ast
    import inspect

    from coordinator.commands import serve
    from coordinator.config import RunConfig

    assert RunConfig().embedded_host == "127.0.0.1"
    calls = [
        n
        for n in ast.walk(ast.parse(inspect.getsource(serve)))
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "EmbeddedBroker"
    ]
    # an unauthenticated broker listens on embedded_host; one given the provisioned fleet
    # (mutual TLS, ACL) listens where the fleet's mosquitto.conf says
    assert calls and all(
        any(k.arg == "host" and "embedded_host" in ast.unparse(k.value) for k in c.keywords)
        or any(k.arg == "fleet" for k in c.keywords)
        for c in calls
    )


def test_a_preset_gives_its_values_under_hyper_and_set(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[run]\nalgorithm = "fedtgp"\npreset = "htfllib"\n[hyper]\nlr = 0.05\n')
    hyper = load_config(path).algorithm_config().to_dict()
    # the preset's values (total.sh: -lam 10 -se 100 -mart 100), the TOML's lr over the preset's
    assert (hyper["proto_weight"], hyper["server_epochs"], hyper["margin_threshold"]) == (
        10.0,
        100,
        100.0,
    )
    assert (hyper["shared_init"], hyper["arch_init"], hyper["lr"]) == ("architecture", True, 0.05)
    over = load_config(path, ["hyper.proto_weight=0.5"]).algorithm_config().to_dict()
    assert over["proto_weight"] == 0.5 and over["server_epochs"] == 100
    plain = load_config(None, ["run.algorithm=fedtgp"]).algorithm_config().to_dict()
    assert (plain["proto_weight"], plain["shared_init"], plain["arch_init"]) == (0.1, "none", False)


def test_a_preset_the_algorithm_lacks_is_an_error() -> None:
    with pytest.raises(ConfigError, match="fedvtc has no preset 'htfllib'"):
        load_config(None, ["run.algorithm=fedvtc", "run.preset=htfllib"])


def test_a_recorded_preset_run_keeps_its_resolved_values() -> None:
    cfg = load_config(None, ["run.algorithm=fml", "run.preset=htfllib"])
    recorded = cfg.to_dict()
    assert recorded["preset"] == "htfllib"
    assert recorded["hyper"]["kl_reduction"] == "elementwise_mean"
    assert recorded["hyper"]["shared_model"] == "client0_arch"


def test_preset_differences_name_each_changed_default() -> None:
    rows = {(a, k): (d, v) for a, k, d, v in preset_differences("htfllib")}
    assert rows[("fedtgp", "proto_weight")] == (0.1, 10.0)
    assert rows[("fedgen", "noise_dim")] == (512, 32)
    assert rows[("fd", "kd_loss")] == ("mse", "soft_ce")
    assert ("fedtgp", "server_epochs") not in rows  # the preset's value is the default
    assert preset_differences("none-such") == []
