"""The README's reference-tier figures are the generated pages': each table row is a row of
``docs/results/reference.md`` and each paired difference it quotes is one of that page's or of
the longer-cap page's (``docs/results/reference_long.md``)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "results" / "reference.md"
LONG_PAGE = ROOT / "docs" / "results" / "reference_long.md"
# a signed difference and its interval, as the page writes them: "+1.84 [+1.44, +2.23]"
DIFFERENCE = re.compile(r"[+\-]\d+\.\d+ \[[+\-]\d+\.\d+, [+\-]\d+\.\d+\]")


def plain(text: str) -> str:
    """``text`` with the typographic minus as ASCII and each run of white space as one space
    (the README wraps its bullets; the page does not)."""
    return re.sub(r"\s+", " ", text.replace("\u2212", "-"))


def reference_section() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return readme.split("### The reference tier", 1)[1].split("\n### ", 1)[0]


def test_the_readme_table_rows_are_rows_of_the_page() -> None:
    page_rows = set(PAGE.read_text(encoding="utf-8").splitlines())
    rows = [line for line in reference_section().splitlines() if line.startswith("| `")]
    assert rows, "no table in the README's reference-tier section"
    assert [row for row in rows if row not in page_rows] == []


def test_the_readme_differences_are_the_pages() -> None:
    page = plain("\n".join(p.read_text(encoding="utf-8") for p in (PAGE, LONG_PAGE)))
    quoted = DIFFERENCE.findall(plain(reference_section()))
    assert quoted, "no paired difference quoted in the README's reference-tier section"
    assert [figure for figure in quoted if figure not in page] == []


def test_the_difference_pattern_reads_a_wrapped_figure() -> None:
    assert DIFFERENCE.findall(plain("gain +0.19 [\u22120.56,\n  +0.94] over")) == [
        "+0.19 [-0.56, +0.94]"
    ]
