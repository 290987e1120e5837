"""protocol.transport.routes and protocol.contract.topics.matches: compiled filters answer exactly
what a plain split-based MQTT matcher (kept here as the oracle) does."""

from __future__ import annotations

import threading

from hypothesis import given
from hypothesis import strategies as st

from protocol.contract.topics import SHARE, matches
from protocol.transport.routes import Routes

LEVEL = st.sampled_from(["a", "b", "dev", "", "$share", "g"])
TOPIC = st.lists(LEVEL, min_size=1, max_size=5).map("/".join)
FILTER = st.lists(st.one_of(LEVEL, st.just("+"), st.just("#")), min_size=1, max_size=5).map(
    "/".join
)


def _split_match(pattern: str, topic: str) -> bool:
    """The oracle: MQTT matching level by level on the split strings."""
    p_parts, t_parts = pattern.split("/"), topic.split("/")
    if p_parts[0] == SHARE and len(p_parts) > 2:
        p_parts = p_parts[2:]
    for i, p in enumerate(p_parts):
        if p == "#":
            return True
        if i >= len(t_parts) or (p != "+" and p != t_parts[i]):
            return False
    return len(p_parts) == len(t_parts)


@given(FILTER, TOPIC)
def test_matches_is_mqtt_matching(topic_filter: str, topic: str) -> None:
    assert matches(topic_filter, topic) == _split_match(topic_filter, topic)


def _one_by_one(filters: list[tuple[str, int]], topic: str, *, distinct: bool) -> list[int]:
    found = [h for f, h in filters if _split_match(f, topic)]
    return list(dict.fromkeys(found)) if distinct else found


@given(
    st.lists(st.tuples(FILTER, st.integers(0, 3)), max_size=8),
    st.lists(TOPIC, min_size=1, max_size=6),
    st.booleans(),
)
def test_the_tree_matches_as_each_filter_does(
    filters: list[tuple[str, int]], topics: list[str], distinct: bool
) -> None:
    routes: Routes[int] = Routes(distinct=distinct)
    for topic_filter, handler in filters:
        routes.add(topic_filter, handler)
    for topic in topics + topics:  # the second pass answers from the cache
        assert routes.handlers(topic) == _one_by_one(filters, topic, distinct=distinct)


def test_shared_filters_match_their_inner_filter_and_wildcards_their_levels() -> None:
    routes: Routes[str] = Routes(distinct=False)
    routes.add("$share/workers/edgefl/v1/f/dev/+/up/#", "ingest")
    routes.add("edgefl/v1/f/dev/+/status", "status")
    routes.add("edgefl/#", "all")
    assert routes.handlers("edgefl/v1/f/dev/d1/up/reply") == ["ingest", "all"]
    assert routes.handlers("edgefl/v1/f/dev/d1/up") == ["ingest", "all"]  # '#' matches none
    assert routes.handlers("edgefl/v1/f/dev/d1/status") == ["status", "all"]
    assert routes.handlers("edgefl") == ["all"]
    assert routes.handlers("other/v1") == []


def test_a_filter_added_later_reaches_topics_seen_before() -> None:
    routes: Routes[str] = Routes(distinct=True)
    routes.add("a/+", "first")
    assert routes.handlers("a/b") == ["first"]
    routes.add("a/b", "second")
    assert routes.handlers("a/b") == ["first", "second"]


def test_the_cache_starts_over_past_its_bound_and_keeps_answering() -> None:
    routes: Routes[str] = Routes(distinct=True, max_cached=4)
    routes.add("dev/+/up", "up")
    for i in range(20):
        assert routes.handlers(f"dev/d{i}/up") == ["up"]
    assert len(routes._state.cache) <= 4


def test_the_remembered_filter_combinations_start_over_past_the_bound_too() -> None:
    # Prepare: 20 filters, each topic below hits a different one (and all hit the last)
    routes: Routes[int] = Routes(distinct=False, max_cached=4)
    for i in range(20):
        routes.add(f"dev/d{i}/+", i)
    routes.add("dev/#", 99)

    # Execute / Assert
    for i in range(20):
        assert routes.handlers(f"dev/d{i}/up") == [i, 99]
    assert routes.handlers("dev") == [99]
    assert routes.handlers("other/d1/up") == []
    assert len(routes._state.by_hits) <= 4


def test_lookups_on_another_thread_while_filters_are_added_see_whole_routes() -> None:
    routes: Routes[int] = Routes(distinct=True)
    routes.add("t/#", 0)
    seen: list[list[int]] = []
    stop = threading.Event()

    def look() -> None:
        while not stop.is_set():
            seen.append(routes.handlers("t/x"))

    reader = threading.Thread(target=look)
    reader.start()
    for h in range(1, 200):
        routes.add("t/+", h)
    stop.set()
    reader.join()
    assert routes.handlers("t/x") == list(range(200))
    # every answer is a prefix of the final one: a snapshot of whole routes, in order
    assert all(answer == list(range(len(answer))) for answer in seen)
