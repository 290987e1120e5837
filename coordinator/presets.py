"""Presets in TOML: a command's defaults and its arms, one file each.

The demo's is ``coordinator/presets/demo.toml`` (package data); the benchmark scripts read
theirs (``benchmarks/presets/*.toml``) with the same reader and the same schema.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (JetPack 6)
    import tomli as tomllib

__all__ = ["PRESETS", "Arm", "Preset", "load_preset"]

PRESETS = Path(__file__).resolve().parent / "presets"


@dataclass(frozen=True)
class Arm:
    """One method of a grid: the registered algorithm it runs and what it sets over the
    script's hyperparameters (``hyper``) and fleet (``fleet``)."""

    algorithm: str
    hyper: dict[str, Any] = field(default_factory=dict)
    fleet: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Preset:
    """A ``<name>.toml`` file: ``[settings]`` (the command line's defaults, by argparse
    ``dest``), ``[arms.<method>]`` (in the file's order), ``[presets.<name>]`` (settings that a
    named preset, ``--preset NAME``, puts over ``[settings]``) and any other tables the reader
    reads (``other``; ``[report]``: what a benchmark's tables compare)."""

    name: str
    settings: dict[str, Any]
    arms: dict[str, Arm]
    named: dict[str, dict[str, Any]]
    other: dict[str, Any]

    def pairs(self, key: str = "pairs") -> tuple[tuple[str, str], ...]:
        """``[report]``'s ``key`` as (a, b) pairs: the paired differences ``a - b`` a table
        shows."""
        return tuple((str(a), str(b)) for a, b in self.other["report"][key])


def load_preset(name: str, folder: Path = PRESETS) -> Preset:
    """Read ``folder/<name>.toml``."""
    doc = tomllib.loads((folder / f"{name}.toml").read_text())
    return Preset(
        name=name,
        settings=doc.pop("settings", {}),
        arms={method: Arm(**arm) for method, arm in doc.pop("arms", {}).items()},
        named=doc.pop("presets", {}),
        other=doc,
    )
