"""What a signing agent does with coordinator states (``docs/concepts/security.md`` item 6).

Only a verified state of the run the agent joined can end it. An unsigned state (the
coordinator's last will, or a forgery) may only say ``offline``; a stale signed one is refused
by the endpoint; a signed ``finished`` of an earlier run is ignored.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from coordinator.sim.simulate import agent_options
from edge_agent.agent import EdgeAgent
from edge_agent.factory import build_agent
from protocol.contract.codec import Envelope, encode
from protocol.contract.messages import CoordinatorState, Register
from protocol.contract.topics import Topics
from protocol.errors import ValidationError
from protocol.security.keys import SigningKeys
from protocol.security.signing import HmacSigner
from protocol.transport.base import MemoryBroker, MemoryTransport
from protocol.transport.endpoint import Endpoint
from tests.helpers_runtime import FLEET, run_config

T = Topics()
COORD = HmacSigner("coordinator", b"coordinator-secret-key")
# another device of the fleet: its key sits in the same verify directory as the coordinator's
PEER = HmacSigner("agent9", b"device-9-secret-key")


class Fleet:
    """A signing agent and a signing coordinator endpoint on one in-memory broker."""

    def __init__(self, tmp_path: Path) -> None:
        self.broker = MemoryBroker()
        opts = agent_options(run_config(tmp_path), FLEET, 0)
        self.device = opts.device_id
        device_signer = HmacSigner(self.device, b"device-0-secret-key")
        self.keys = SigningKeys(
            device_signer, {"coordinator": COORD.verify_key(), "agent9": PEER.verify_key()}
        )
        keys = self.keys
        transport = MemoryTransport(self.broker, self.device)
        self.agent: EdgeAgent = build_agent(opts, transport, signing=keys)
        coord_t = MemoryTransport(self.broker, "coordinator")
        coord_t.connect()
        self.coord = Endpoint(coord_t, sender="coordinator", signer=COORD)
        self.rogue = MemoryTransport(self.broker, "rogue")
        self.rogue.connect()
        self.peer = Endpoint(self.rogue, sender="agent9", signer=PEER)
        self.registers: list[Register] = []
        coord_t.subscribe(f"{T.base}/dev/+/up/register", lambda t, d: self.registers.append(d))
        transport.connect()
        self.agent.start()
        self.pump()

    def pump(self) -> None:
        """Handle everything the agent received (its run loop, without blocking)."""
        while not self.agent.inbox.empty():
            self.agent.dispatch(self.agent.inbox.get_nowait())

    def signed(self, state: CoordinatorState, ts: float | None = None) -> None:
        env = Envelope(body=state, sender="coordinator", ts=time.time() if ts is None else ts)
        self.coord.send_envelope(T.coord_state, env, retain=True)
        self.pump()

    def signed_by_peer(self, state: CoordinatorState) -> None:
        env = Envelope(body=state, sender="agent9", ts=time.time())
        self.peer.send_envelope(T.coord_state, env, retain=True)
        self.pump()

    def unsigned(self, state: CoordinatorState) -> None:
        self.rogue.publish(
            T.coord_state, encode(Envelope(body=state, sender="coordinator")), retain=True
        )
        self.pump()


def state(kind: str, run_id: str = "r1", round_: int = 3) -> CoordinatorState:
    return CoordinatorState(
        state=kind, run_id=run_id, algorithm="fedproto", round=round_, total_rounds=3
    )


def test_a_signed_finished_of_the_joined_run_ends_the_agent(tmp_path: Path) -> None:
    # Prepare
    fleet = Fleet(tmp_path)
    fleet.signed(state("running", round_=1))
    # Execute
    fleet.signed(state("finished"))
    # Assert
    assert fleet.agent.finished.is_set() and fleet.agent.gave_up is None


def test_an_unsigned_finished_is_ignored_and_counted(tmp_path: Path) -> None:
    # Prepare
    fleet = Fleet(tmp_path)
    fleet.signed(state("running", round_=1))
    # Execute: a forged retained end of the run the agent joined, and a forged (re)start
    fleet.unsigned(state("finished"))
    registered = len(fleet.registers)
    fleet.unsigned(state("starting", "r2"))
    # Assert: the agent goes on, did not register with the forged run, counted both
    assert not fleet.agent.finished.is_set()
    assert len(fleet.registers) == registered and "r2" not in fleet.agent.joined
    assert fleet.agent.endpoint.rejected["unsigned_coord_state"] == 2


def test_an_unsigned_offline_will_is_a_hint_only(tmp_path: Path) -> None:
    # Prepare
    fleet = Fleet(tmp_path)
    fleet.signed(state("running", round_=1))
    registered = len(fleet.registers)
    # Execute: the coordinator's will, then the coordinator back with the same run
    fleet.unsigned(state("offline", round_=1))
    fleet.signed(state("running", round_=1))
    # Assert: presence only, which makes the agent register again with the live coordinator
    assert not fleet.agent.finished.is_set()
    assert fleet.agent.endpoint.rejected["unsigned_coord_state"] == 0
    assert len(fleet.registers) == registered + 1


def test_a_stale_signed_finished_is_refused(tmp_path: Path) -> None:
    # Prepare
    fleet = Fleet(tmp_path)
    fleet.signed(state("running", round_=1))
    # Execute: signed by the coordinator, but older than the 300 s window (a retained state
    # nobody refreshed, or a capture replayed later)
    fleet.signed(state("finished"), ts=time.time() - 400)
    # Assert
    assert not fleet.agent.finished.is_set()
    assert fleet.agent.endpoint.rejected["SignatureError"] == 1


def test_a_replayed_signed_finished_of_an_earlier_run_is_ignored(tmp_path: Path) -> None:
    # Prepare: the agent joins r2; a genuine "finished" of r1 was captured within the window
    fleet = Fleet(tmp_path)
    captured: list[bytes] = []
    fleet.rogue.subscribe(T.coord_state, lambda t, d: captured.append(d))
    fleet.signed(state("finished", "r1"))
    fleet.signed(state("running", "r2", 1))
    # Execute: the capture replayed as is (refused: replay cache), and r1's end signed anew
    fleet.rogue.publish(T.coord_state, captured[-1], retain=True)
    fleet.pump()
    fleet.signed(state("finished", "r1"))
    # Assert: neither ends r2
    assert not fleet.agent.finished.is_set()
    assert fleet.agent.endpoint.rejected["SignatureError"] == 1


def test_a_state_signed_by_another_device_is_ignored_and_counted(tmp_path: Path) -> None:
    # Prepare: agent9's key verifies (it is in the verify directory), but agent9 is no
    # coordinator: holding a device kit must not end or redirect the fleet
    fleet = Fleet(tmp_path)
    fleet.signed(state("running", round_=1))
    registered = len(fleet.registers)
    # Execute: a signed end of the joined run and a signed (re)start of another run
    fleet.signed_by_peer(state("finished"))
    fleet.signed_by_peer(state("starting", "r2"))
    # Assert: the agent goes on, did not register with r2, counted both; signatures were fine
    assert not fleet.agent.finished.is_set()
    assert len(fleet.registers) == registered and "r2" not in fleet.agent.joined
    assert fleet.agent.endpoint.rejected["foreign_coord_state"] == 2
    assert fleet.agent.endpoint.rejected["SignatureError"] == 0
    # the coordinator itself still ends it
    fleet.signed(state("finished"))
    assert fleet.agent.finished.is_set()


def test_waiting_to_join_trusts_only_the_coordinators_states(tmp_path: Path) -> None:
    # Prepare: the frames an agent waiting to join reads off the retained coord_state topic
    from edge_agent.joining import trusted_state

    verifier = SigningKeys(PEER, {"coordinator": COORD.verify_key(), "agent9": PEER.verify_key()})
    frames: list[bytes] = []
    sink = MemoryTransport(MemoryBroker(), "sink")
    sink.connect()
    sink.subscribe(T.coord_state, lambda t, d: frames.append(d))
    for sender, signer in (("coordinator", COORD), ("agent9", PEER)):
        env = Envelope(body=state("starting", "r2"), sender=sender, ts=time.time())
        Endpoint(sink, sender=sender, signer=signer).send_envelope(T.coord_state, env)
    # Execute / Assert: the coordinator's is adopted, the peer's refused naming the sender
    assert trusted_state(frames[0], verifier.verifier()).run_id == "r2"
    with pytest.raises(ValidationError, match="coord_state sender: expected 'coordinator'"):
        trusted_state(frames[1], verifier.verifier())
