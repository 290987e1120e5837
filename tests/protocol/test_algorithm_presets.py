"""Algorithm presets: every preset names existing keys with values the config accepts, an
unknown preset is an error naming the known ones, and the docs' table states each value."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from protocol.algorithms import CONFIG_TYPES, config_type
from protocol.algorithms.base import HTFLLIB_TRAINING
from protocol.errors import ConfigError

PRESETS = [(name, preset) for name, cls in sorted(CONFIG_TYPES.items()) for preset in cls.PRESETS]
HTFLLIB = ["fd", "fedgen", "fedgh", "fedkd", "fedktl", "fedproto", "fedtgp", "fml", "lg_fedavg"]
DOC = Path(__file__).resolve().parents[2] / "docs" / "algorithms" / "baselines.md"


def test_the_htfllib_preset_covers_the_reviewed_algorithms() -> None:
    assert {n for n, p in PRESETS if p == "htfllib"} == {*HTFLLIB, "local"}


@pytest.mark.parametrize(("algorithm", "preset"), PRESETS)
def test_each_preset_names_known_keys_with_valid_values(algorithm: str, preset: str) -> None:
    cls = config_type(algorithm)
    values = cls.preset(preset)
    fields = set(cls().to_dict())
    assert set(values) <= fields, sorted(set(values) - fields)
    cfg = cls.from_dict(values)  # types, Literal choices, LIMITS and __post_init__ rules
    assert {k: getattr(cfg, k) for k in values} == values


@pytest.mark.parametrize("algorithm", [*HTFLLIB, "local"])
def test_every_htfllib_preset_trains_as_htfllib_clients(algorithm: str) -> None:
    values = config_type(algorithm).preset("htfllib")
    assert {k: values[k] for k in HTFLLIB_TRAINING} == HTFLLIB_TRAINING


def test_a_value_outside_the_limits_would_be_refused() -> None:
    # the check the preset test relies on: a preset value is validated like any hyper value
    cls = config_type("fedtgp")
    with pytest.raises(ConfigError, match="server_epochs"):
        cls.from_dict({**cls.preset("htfllib"), "server_epochs": 10**6})


def test_an_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"fedvtc has no preset 'htfllib'; its presets: none"):
        config_type("fedvtc").preset("htfllib")
    with pytest.raises(ConfigError, match=r"its presets: \['htfllib'\]"):
        config_type("fedtgp").preset("flower")
    assert config_type("fedvtc").preset("") == {}


def _documented() -> dict[tuple[str, str], Any]:
    """(algorithm, key) -> value from the docs' preset table (rows `| `alg` | `key` | value |`)."""
    rows: dict[tuple[str, str], Any] = {}
    section = DOC.read_text().split("### The `htfllib` preset", 1)[1].split("\n### ", 1)[0]
    for line in section.splitlines():
        m = re.match(r"\| `(\w+)` \| `(\w+)` \| `([^`]*)` \|", line)
        if m:
            algorithms = [*HTFLLIB, "local"] if m[1] == "all" else [m[1]]
            for algorithm in algorithms:
                rows[(algorithm, m[2])] = m[3]
    return rows


def test_the_docs_table_states_every_preset_value() -> None:
    documented = _documented()
    expected = {
        (algorithm, key): value
        for algorithm in [*HTFLLIB, "local"]
        for key, value in config_type(algorithm).preset("htfllib").items()
    }
    assert set(documented) == set(expected)
    for (algorithm, key), value in expected.items():
        text = documented[(algorithm, key)]
        shown = str(value).lower() if isinstance(value, bool) else str(value)
        assert text == shown, (algorithm, key, text, value)
