"""Fixtures shared by every test suite: real brokers for the ``network`` tests.

``mosquitto`` starts Debian's mosquitto on a free loopback port for one test (about 15 ms)
and yields a :class:`protocol.broker.MosquittoBroker` (``.host``, ``.port``, ``.stop()``,
``.start()`` to restart on the same port). ``embedded_broker`` does the same with the
in-process amqtt broker. Without mosquitto the tests skip, except in CI (``CI`` set), where a
missing broker is a failure: CI installs it, so a skip there would hide a broken set-up.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from protocol.broker import EmbeddedBroker, MosquittoBroker, mosquitto_executable


def _missing(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: install it instead of skipping)")
    pytest.skip(reason)


@pytest.fixture
def mosquitto() -> Iterator[MosquittoBroker]:
    """A running mosquitto on 127.0.0.1 with a free port, killed on teardown."""
    if mosquitto_executable() is None:
        _missing("mosquitto is not installed (apt-get install mosquitto)")
    broker = MosquittoBroker()
    broker.start()
    try:
        yield broker
    finally:
        broker.cleanup()


@pytest.fixture
def embedded_broker() -> Iterator[EmbeddedBroker]:
    """The in-process amqtt broker on a free loopback port."""
    try:
        import amqtt  # noqa: F401
    except ImportError:
        _missing("amqtt is not installed (pip install edgefl[broker])")
    with EmbeddedBroker() as broker:
        yield broker
