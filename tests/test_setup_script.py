"""``scripts/setup.sh`` is the one set-up of the README's ``make test`` and of CI: it installs
every extra the tests exercise, so that no test skips for want of a package it installs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (JetPack 6)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
# not for the tests: `gpu` replaces `cpu` (they overwrite each other's files), `bench` is the
# benchmarks' own
NOT_FOR_TESTS = {"gpu", "bench"}


def installed_extras() -> set[str]:
    text = (ROOT / "scripts" / "setup.sh").read_text()
    match = re.search(r'-e "\.\[([a-z,]+)\]"', text)
    assert match is not None, 'setup.sh installs the package with its extras (-e ".[...]")'
    return set(match.group(1).split(","))


def test_setup_installs_every_extra_the_tests_exercise() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(declared["optional-dependencies"])
    assert installed_extras() == extras - NOT_FOR_TESTS


def test_ci_runs_the_readmes_set_up_and_nothing_else() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    assert "make setup" in script or "make test" in script
    assert not re.search(r"pip\S* install", script)
