"""Every relative link in README.md and docs/ points at a file that exists (and, for a
``#fragment`` into a markdown file, at one of its headings)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```", re.S)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in CODE.sub("", page.read_text(encoding="utf-8")).splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return out


def links(page: Path) -> list[str]:
    """The link targets of ``page`` outside code blocks."""
    return LINK.findall(CODE.sub("", page.read_text(encoding="utf-8")))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        missing_heading = dest.suffix == ".md" and fragment and fragment not in anchors(dest)
        if not dest.exists() or missing_heading:
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


def test_the_link_pattern_finds_links() -> None:
    assert LINK.findall("see [a](b.md#c) and ![img](x.png)") == ["b.md#c"]
