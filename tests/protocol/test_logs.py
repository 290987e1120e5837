"""Message text shared by logs and errors, and the refusal log's rate limit."""

import logging

import pytest

from protocol.logs import RefusalLog, listing


def test_a_listing_names_the_first_items_and_counts_the_rest() -> None:
    def _first(items: list[str]) -> str:  # the coordinator's online line: 100 names
        return listing(items, 100)

    names = [f"a{i}" for i in range(250)]
    line = _first(names)
    assert line.startswith("a0, a1, ") and line.endswith("a99 and 150 more")
    assert _first(names[:3]) == "a0, a1, a2"
    assert _first(names[:100]).endswith("a98, a99")  # exactly the limit: all of them


def test_a_flood_of_refusals_takes_a_few_lines_and_one_summary_an_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: a fake clock; 3 lines an interval of 10 s
    now = [0.0]
    log = logging.getLogger("edgefl.test.refusals")
    refusals = RefusalLog(log, first=3, interval_s=10.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, log.name)

    # Execute: 1,000 late replies and 5 invalid ones in one interval, then one more later
    for i in range(1000):
        refusals("late", "rejected (late): reply %d", i)
    for i in range(5):
        refusals("invalid_reply", "rejected (invalid_reply): %d", i)
    lines_in_interval = [r.getMessage() for r in caplog.records]
    now[0] = 10.5
    refusals.tick()
    refusals("late", "rejected (late): reply %d", 1000)

    # Assert: the first three in full, the rest summed up by reason once the interval ended
    assert lines_in_interval == [f"rejected (late): reply {i}" for i in range(3)]
    summary, after = [r.getMessage() for r in caplog.records][3:]
    assert summary == (
        "refused 1,005 frames in the last 10 s (1,002 not logged one by one): "
        "late 1,000, invalid_reply 5"
    )
    assert after == "rejected (late): reply 1000"  # a new interval logs again


def test_flush_sums_up_what_was_not_logged_and_nothing_else(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refusals = RefusalLog(logging.getLogger("edgefl.test.flush"), first=1, what="messages")
    caplog.set_level(logging.WARNING, "edgefl.test.flush")
    refusals("late", "one")
    refusals.flush()
    assert [r.getMessage() for r in caplog.records] == ["one"]  # all logged: no summary
    refusals("late", "two")
    refusals("late", "three")
    refusals.flush()
    messages = [r.getMessage() for r in caplog.records]
    assert messages[1] == "two" and messages[2].startswith("refused 2 messages in the last")
