"""Message text shared by logs and errors."""

from protocol.logs import listing


def test_a_listing_names_the_first_items_and_counts_the_rest() -> None:
    def _first(items: list[str]) -> str:  # the coordinator's online line: 100 names
        return listing(items, 100)

    names = [f"a{i}" for i in range(250)]
    line = _first(names)
    assert line.startswith("a0, a1, ") and line.endswith("a99 and 150 more")
    assert _first(names[:3]) == "a0, a1, a2"
    assert _first(names[:100]).endswith("a98, a99")  # exactly the limit: all of them
