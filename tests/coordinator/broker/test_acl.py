"""The fleet ACL as the embedded broker reads it (``coordinator.broker.acl``), against the file
``coordinator provision`` writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.broker.acl import Acl, covers
from coordinator.ops.provision import acl_text
from protocol.contract.topics import Topics, matches
from protocol.errors import ConfigError

BASE = Topics("f").base


@pytest.mark.parametrize(
    ("topic_filter", "topic", "expected"),
    [
        ("a/b", "a/b", True),
        ("a/+", "a/b", True),
        ("a/+", "a/b/c", False),
        ("a/#", "a", True),  # MQTT 3.1.1 §4.7.1.2: "#" also matches the parent level
        ("a/#", "a/b/c", True),
        ("a/b", "a/c", False),
        ("a/b/c", "a/b", False),
    ],
)
def test_matches_follows_mqtt_wildcards(topic_filter: str, topic: str, expected: bool) -> None:
    assert matches(topic_filter, topic) is expected


@pytest.mark.parametrize(
    ("allowed", "requested", "expected"),
    [
        ("a/x/down/#", "a/x/down/#", True),
        ("a/x/down/#", "a/x/down/task", True),
        ("a/+/down/#", "a/+/down/#", True),
        ("a/x/down/#", "a/+/down/#", False),  # widening a level is not covered
        ("a/x/down/#", "a/#", False),
        ("a/x/down/#", "#", False),
        ("a/x/down", "a/x/down/#", False),
        ("a/#", "a/+/b", True),
    ],
)
def test_a_subscription_is_allowed_only_if_covered(
    allowed: str, requested: str, expected: bool
) -> None:
    assert covers(allowed, requested) is expected


def test_the_provisioned_acl_gives_a_device_its_own_topics_and_the_coordinator_all() -> None:
    acl = Acl.parse(acl_text("f"))
    # a device: its own tasks and broadcasts to read, its own replies and status to write
    assert acl.allows("agent0", "read", f"{BASE}/dev/agent0/down/#", is_filter=True)
    assert acl.allows("agent0", "read", f"{BASE}/coord/state")
    assert acl.allows("agent0", "write", f"{BASE}/dev/agent0/up/reply")
    assert acl.allows("agent0", "write", f"{BASE}/dev/agent0/status")
    # ... and nothing of another device's, nor the coordinator's state, nor a wider filter
    assert not acl.allows("agent0", "read", f"{BASE}/dev/agent1/down/task")
    assert not acl.allows("agent0", "read", f"{BASE}/dev/+/down/#", is_filter=True)
    assert not acl.allows("agent0", "write", f"{BASE}/dev/agent1/up/reply")
    assert not acl.allows("agent0", "write", f"{BASE}/coord/state")
    assert acl.allows("agent0", "read", f"{BASE}/dev/agent0/down/task")  # delivery
    # another federation is out of reach for everyone
    assert not acl.allows("coordinator", "read", Topics("g").coord_state)
    assert acl.allows("coordinator", "write", f"{BASE}/dev/agent7/down/task")
    assert acl.allows("coordinator", "read", f"{BASE}/#", is_filter=True)


def test_a_username_with_wildcards_or_slashes_gets_nothing_from_a_pattern() -> None:
    acl = Acl.parse(acl_text("f"))
    for name in ("+", "#", "agent0/down"):
        assert not acl.allows(name, "read", f"{BASE}/dev/{name}/down/#", is_filter=True)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("pattern sometimes a/b\n", "access 'sometimes'"),
        ("topic read a/b\n", "`topic` before any `user`"),
        ("deny a/b\n", "acl:1: 'deny a/b'"),
    ],
)
def test_lines_outside_the_understood_subset_are_refused(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Acl.parse(text)


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"ACL file .*missing"):
        Acl.read(tmp_path / "missing")
