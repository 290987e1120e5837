"""Connect listeners: held per transport from construction, called on every (re)connect."""

from protocol.transport.base import MemoryBroker, MemoryTransport


def test_listeners_run_on_every_connect_and_a_failing_one_spares_the_rest() -> None:
    # Prepare
    broker = MemoryBroker()
    t, other = MemoryTransport(broker, "a"), MemoryTransport(broker, "b")
    calls: list[bool] = []

    def broken(_present: bool) -> None:
        raise RuntimeError("listener bug")

    t.add_connect_listener(broken)
    t.add_connect_listener(calls.append)
    # Execute
    t.connect()
    t.close()
    t.connect()
    other.connect()
    # Assert
    assert calls == [False, False]  # once per connect; the other transport has none
    assert other.max_packet_size is None
