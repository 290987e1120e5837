"""Run config: TOML + overrides, unknown keys and wrong types are errors."""

from pathlib import Path

import pytest

from coordinator.config import load_config, parse_override
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
