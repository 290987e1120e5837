"""The privacy page's table of what leaves a device is generated from the code and current."""

from __future__ import annotations

from coordinator.disclosure import DOC, disclosure_table, main
from coordinator.strategies import STRATEGIES


def test_the_privacy_page_holds_the_current_table_of_every_algorithm() -> None:
    table = disclosure_table()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert {r.split("`")[1] for r in rows} >= set(STRATEGIES)
    assert table in DOC.read_text()
    assert main(["--check"]) == 0


def test_the_table_says_which_algorithms_register_the_histogram() -> None:
    lines = disclosure_table().splitlines()
    rows = {line.split("`")[1]: line for line in lines if line.startswith("| `")}
    for name, cls in STRATEGIES.items():
        assert ("class_counts" in rows[name]) == cls.needs_class_counts, rows[name]
