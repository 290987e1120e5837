"""Forged chunk frames must not starve other senders' reassembly (``docs/concepts/security.md``).

Four forged chunk frames of ~130 B, each announcing a 64 MiB message, would reserve the whole
256 MiB reassembly budget if it were shared by all senders, and a genuine 1.2 MB reply would be
refused and lost. On a real Mosquitto with the default chunk policy, the genuine reply must arrive
whether the forger uses its own id or the victim's.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from helpers import Inbox, unique_id, wait_for

from coordinator.broker.embedded import MosquittoBroker
from protocol.contract.codec import DEFAULT_MAX_MESSAGE, Envelope, encode
from protocol.contract.messages import Chunk, Reply
from protocol.contract.payloads import TensorMap
from protocol.contract.topics import Topics
from protocol.transport.endpoint import Endpoint
from protocol.transport.paho import MqttTransport

pytestmark = pytest.mark.network

FED = "sec"
T = Topics(FED)


@pytest.fixture
def transports(mosquitto: MosquittoBroker) -> Iterator[dict[str, MqttTransport]]:
    made = {
        name: MqttTransport(client_id=unique_id(name), port=mosquitto.port)
        for name in ("coord", "agent0", "forger")
    }
    yield made
    for t in made.values():
        t.close()


def _genuine_reply() -> Reply:
    w = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)  # 1.2 MB
    return Reply(
        task_id="t1", round=1, phase="train", num_samples=5, payloads={"w": TensorMap({"w": w})}
    )


@pytest.mark.parametrize("forged_as", ["mallory", "agent0"])
def test_forged_chunk_frames_do_not_starve_a_genuine_large_reply(
    transports: dict[str, MqttTransport], forged_as: str
) -> None:
    # Set up: the coordinator's endpoint hears every device, with the default chunk policy
    coord = Endpoint(transports["coord"], sender="coordinator", federation=FED)
    got = Inbox()
    coord.subscribe(f"{T.base}/dev/+/up/#", got)
    agent = Endpoint(transports["agent0"], sender="agent0", federation=FED)
    for t in transports.values():
        t.connect()

    # Execute: four ~130-byte chunk frames, each announcing a message at the size cap
    forger = transports["forger"]
    for i in range(4):
        chunk = Chunk(
            digest=bytes([i + 1]) * 32, index=0, count=2, total_size=DEFAULT_MAX_MESSAGE, data=b"x"
        )
        frame = encode(Envelope(body=chunk, sender=forged_as, federation=FED))
        assert len(frame) < 200
        forger.publish(T.chunk_topic(T.up(forged_as, "reply")), frame)
    assert wait_for(lambda: coord.traffic.chunks[("rx", "chunk")] >= 4, 20)
    reply = _genuine_reply()
    agent.send(T.up("agent0", "reply"), reply, round=1)

    # Verify: the genuine reply arrives whole; the forged partials hold almost nothing
    assert got.wait(1, timeout=30), f"genuine reply lost; rejected: {dict(coord.rejected)}"
    env = got.items[0][0]
    assert isinstance(env, Envelope) and isinstance(env.body, Reply)
    received = env.body.payloads["w"]
    assert isinstance(received, TensorMap)
    np.testing.assert_array_equal(received.tensors["w"], reply.payloads["w"].tensors["w"])  # type: ignore[union-attr]
    assert coord._reassembler.held_bytes < 1024
    coord.close()
    agent.close()
