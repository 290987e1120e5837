"""The endpoint tells handlers which envelopes were verified (``Envelope.verified``, ``trusted``).

With signatures required, the last wills (``unsigned_kinds``) still arrive, but flagged as not
verified, so that a handler can treat them as presence hints only (``WIRE.md`` §7).
"""

from __future__ import annotations

from protocol.codec import Envelope, encode
from protocol.endpoint import Endpoint
from protocol.messages import Ack, Status
from protocol.signing import HmacSigner, Verifier
from protocol.topics import Topics
from protocol.transport import MemoryBroker, MemoryTransport

T = Topics("fed")
DEV = HmacSigner("dev1", b"device-1-secret-key")


def _pair(require: bool) -> tuple[Endpoint, MemoryTransport, list[Envelope]]:
    broker = MemoryBroker()
    agent_t, coord_t, rogue_t = (MemoryTransport(broker, n) for n in ("dev1", "coord", "rogue"))
    for t in (agent_t, coord_t, rogue_t):
        t.connect()
    coord = Endpoint(
        coord_t,
        sender="coord",
        federation="fed",
        verifier=Verifier({"dev1": DEV.verify_key()}),
        require_signatures=require,
        unsigned_kinds=frozenset({"status"}),
    )
    got: list[Envelope] = []
    coord.subscribe(f"{T.base}/dev/+/#", lambda e, t: got.append(e))
    agent = Endpoint(agent_t, sender="dev1", federation="fed", signer=DEV)
    agent.send(T.status("dev1"), Status(state="online"))
    return coord, rogue_t, got


def _will() -> bytes:
    return encode(Envelope(body=Status(state="offline"), sender="dev1", federation="fed"))


def test_signed_frames_arrive_verified_and_wills_unverified() -> None:
    # Prepare
    coord, rogue, got = _pair(require=True)
    # Execute: the broker publishes the agent's (unsigned) last will
    rogue.publish(T.status("dev1"), _will())
    # Assert
    assert [(e.body, e.verified, coord.trusted(e)) for e in got] == [
        (Status(state="online"), True, True),
        (Status(state="offline"), False, False),
    ]


def test_without_required_signatures_unsigned_frames_are_trusted() -> None:
    # Prepare
    coord, rogue, got = _pair(require=False)
    # Execute
    rogue.publish(T.up("dev1", "ack"), encode(Envelope(body=Ack(ref_id="r"), sender="dev1")))
    # Assert: still flagged as not verified, but nothing is required of it
    assert [(e.verified, coord.trusted(e)) for e in got] == [(True, True), (False, True)]


def test_only_exempt_kinds_pass_unsigned() -> None:
    # Prepare
    coord, rogue, got = _pair(require=True)
    # Execute: an unsigned ack is not a will
    rogue.publish(T.up("dev1", "ack"), encode(Envelope(body=Ack(ref_id="r"), sender="dev1")))
    # Assert
    assert [e.kind for e in got] == ["status"] and coord.rejected == {"SignatureError": 1}
