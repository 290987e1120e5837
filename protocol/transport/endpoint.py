"""Typed messaging over a byte transport: encode, sign, chunk, count, dedupe, verify, dispatch.

An :class:`Endpoint` is what coordinator and agents use: ``send(topic, body)`` and
``subscribe(filter, handler)`` with :class:`~protocol.contract.codec.Envelope` objects. Below that
API
it signs frames (optional), splits large frames into chunks and reassembles them, answers and
issues chunk requests, and counts the bytes on the wire. Rejected input (undecodable, invalid,
oversized, unsigned, tampered, replayed, duplicated) is logged and counted in
:attr:`Endpoint.rejected`, never delivered and never raised into the transport's thread;
partial chunked messages evicted to make room for others count there as ``evicted``.

Byte accounting (``WIRE.md`` §Byte accounting): :attr:`Endpoint.traffic` counts the encoded
bytes of every frame published or received, under the kind of the message the frame carries;
chunk frames count under the kind of the message they are pieces of, with the number of
chunk frames in ``traffic.chunks``. Received chunks count under ``chunk`` until their message
is complete (bytes of messages never completed stay there). Refused bytes count apart
(``traffic.refused``): frames this endpoint rejects under ``invalid``, and messages a handler
refuses (:meth:`Endpoint.refuse`) under their kind, so ``bytes`` are the accepted traffic and
the two together add up to the bytes on the wire. Rejections are logged through a
:class:`~protocol.logs.RefusalLog` (a few lines, then one summary line an interval).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace

from protocol.contract.chunking import (
    DEFAULT_CHUNK_POLICY,
    ChunkPolicy,
    Reassembler,
    SentCache,
    SentFrame,
    request_filter,
    split_frame,
)
from protocol.contract.codec import Envelope, Limits, decode_frame_map, encode, envelope_from_map
from protocol.contract.messages import Chunk, ChunkRequest, Message
from protocol.contract.topics import CHUNKS, Topics
from protocol.errors import LimitError, ProtocolError, SignatureError
from protocol.logs import RefusalLog
from protocol.security.signing import Signer, Verifier
from protocol.transport.base import Transport
from protocol.transport.chunk_exchange import ChunkExchange
from protocol.transport.routes import Routes
from protocol.transport.traffic import TrafficCounter

__all__ = ["Endpoint", "EnvelopeHandler"]

EnvelopeHandler = Callable[[Envelope, str], None]
MQTT_HEADROOM = 64  # fixed header, packet id and MQTT 5 properties around a PUBLISH payload
INVALID = "invalid"  # traffic kind of frames rejected before their kind was known


class Endpoint(ChunkExchange):
    """Send and receive typed envelopes for one participant (``sender``) of a federation.

    Args:
        transport: The byte transport (MQTT or in-memory).
        sender: This participant's id (device id, or the coordinator's id); also the key id
            of ``signer``.
        federation: Federation id, for envelopes and the topic layout.
        limits: Decoder limits; ``limits.max_message`` also caps reassembled messages.
        dedupe_window: How many ``(sender, msg_id)`` pairs are remembered to drop duplicates.
        chunking: Chunk threshold, reassembly bounds and timeouts.
        signer: Signs every outgoing frame (chunks included) when given.
        verifier: Verifies signed incoming frames; a signed frame without one is rejected.
        require_signatures: Reject unsigned frames.
        unsigned_kinds: Kinds still accepted unsigned when signatures are required, such as
            ``{"status"}`` for the last will, which the broker publishes long after it was made
            (a signed will would be stale; treat status as a hint, not as evidence). They
            arrive with ``Envelope.verified`` false: see :meth:`trusted`.
        on_duplicate: Called (on the transport thread) with each dropped duplicate, e.g. so
            the coordinator can acknowledge again a reply whose first ack was lost.
        clock: Monotonic clock for chunk timeouts (tests inject a fake one).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        sender: str,
        federation: str = "default",
        limits: Limits = Limits(),  # noqa: B008 - frozen dataclass, safe as a default
        dedupe_window: int = 4096,
        logger: logging.Logger | None = None,
        chunking: ChunkPolicy = DEFAULT_CHUNK_POLICY,
        signer: Signer | None = None,
        verifier: Verifier | None = None,
        require_signatures: bool = False,
        unsigned_kinds: frozenset[str] = frozenset(),
        on_duplicate: EnvelopeHandler | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if signer is not None and signer.key_id != sender:
            raise SignatureError(
                f"signer key id {signer.key_id!r} must equal the sender {sender!r}"
            )
        if require_signatures and verifier is None:
            raise SignatureError("require_signatures=True needs a verifier")
        self.transport = transport
        self.sender = sender
        self.federation = federation
        self.topics = Topics(federation)
        self.limits = limits
        self.chunking = chunking
        self.signer = signer
        self.verifier = verifier
        self.require_signatures = require_signatures
        self.unsigned_kinds = unsigned_kinds
        self.on_duplicate = on_duplicate
        self.traffic = TrafficCounter()
        self.rejected: Counter[str] = Counter()
        self.log = logger or logging.getLogger(f"edgefl.endpoint.{sender}")
        self.refusals = RefusalLog(self.log)  # a flood of bad frames: a few lines, then sums
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._seen_lock = threading.Lock()
        self._dedupe_window = dedupe_window
        self._routes: Routes[EnvelopeHandler] = Routes(distinct=False)
        self._reassembler = Reassembler(chunking, limits.max_message, clock)
        self._sent = SentCache(chunking.sent_cache_bytes)
        self._request_filters: set[str] = set()
        self._sweeper: threading.Thread | None = None
        self._sweeper_lock = threading.Lock()
        self._stop = threading.Event()

    # -- sending ---------------------------------------------------------------------------

    def send(
        self,
        topic: str,
        body: Message,
        *,
        round: int = 0,
        qos: int = 1,
        retain: bool = False,
        msg_id: str | None = None,
    ) -> Envelope:
        """Encode ``body`` in an envelope from this endpoint and publish it."""
        env = self.envelope(body, round=round)
        if msg_id:
            env = replace(env, msg_id=msg_id)
        self.send_envelope(topic, env, qos=qos, retain=retain)
        return env

    def envelope(self, body: Message, *, round: int = 0) -> Envelope:
        """``body`` in a new envelope from this endpoint (what :meth:`send` sends)."""
        return Envelope(body=body, sender=self.sender, federation=self.federation, round=round)

    def sealed(self, env: Envelope) -> bytes:
        """The frame :meth:`send_envelope` publishes for ``env`` (signed if this endpoint
        signs): its size is known before it is sent."""
        return self.seal(encode(env))

    def send_envelope(
        self,
        topic: str,
        env: Envelope,
        *,
        qos: int = 1,
        retain: bool = False,
        frame: bytes | None = None,
    ) -> None:
        """Publish an already built envelope (e.g. a reply resent from an outbox); ``frame``:
        its :meth:`sealed` frame, when made beforehand.

        Raises:
            LimitError: the frame exceeds ``limits.max_message``, or would need chunking but
                ``retain`` is set (bulk data is never retained).
            TransportError: the transport could not queue a frame.
        """
        frame = self.sealed(env) if frame is None else frame
        self._publish(topic, frame, env.kind, env.round, qos=qos, retain=retain)

    def send_unsigned(self, topic: str, unsigned: bytes, *, kind: str, round: int) -> None:
        """Seal (sign, if this endpoint signs) and publish an unsigned frame of a ``kind``
        message made beforehand (a :class:`~protocol.contract.codec.FrameTemplate`'s), as
        :meth:`send_envelope` publishes an envelope's; QoS 1, never retained.

        Raises:
            LimitError, TransportError: as :meth:`send_envelope`.
        """
        self.send_many_unsigned([(topic, unsigned)], kind=kind, round=round)

    def send_many_unsigned(
        self, messages: Sequence[tuple[str, bytes]], *, kind: str, round: int
    ) -> None:
        """:meth:`send_unsigned` each ``(topic, unsigned frame)`` of one ``kind``: a step's
        tasks, a batch's acks. Sealed, then as :meth:`send_many_sealed`."""
        sealed = [(topic, self.seal(unsigned)) for topic, unsigned in messages]
        self.send_many_sealed(sealed, kind=kind, round=round)

    def send_many_sealed(
        self, messages: Sequence[tuple[str, bytes]], *, kind: str, round: int
    ) -> None:
        """Publish each ``(topic, frame)`` of frames :meth:`seal` made (their size counted
        beforehand, say), as :meth:`send_unsigned` does: the frames that go whole are handed to
        the transport at once (:meth:`Transport.publish_many`) and counted once, then any to
        chunk go as chunk frames (each to its own topic: no order between topics is promised).

        Raises:
            LimitError: a frame exceeds ``limits.max_message`` (raised before any is sent).
            TransportError: as :meth:`send_envelope`.
        """
        whole: list[tuple[str, bytes]] = []
        chunked: list[tuple[str, bytes]] = []
        for topic, frame in messages:
            self._check_size(frame, kind)
            (whole if len(frame) <= self._frame_limit(topic) else chunked).append((topic, frame))
        if whole:
            self.transport.publish_many(whole, qos=1)
            self.traffic.add("tx", kind, sum(len(f) for _, f in whole), messages=len(whole))
        for topic, frame in chunked:
            self._send_chunked(topic, kind, round, frame, 1)

    def _check_size(self, frame: bytes, kind: str) -> None:
        if len(frame) > self.limits.max_message:
            raise LimitError(
                f"{kind}: {len(frame)}-byte frame exceeds the {self.limits.max_message}-byte cap"
            )

    def _publish(
        self, topic: str, frame: bytes, kind: str, round: int, *, qos: int, retain: bool
    ) -> None:
        self._check_size(frame, kind)
        if len(frame) <= self._frame_limit(topic):
            self.transport.publish(topic, frame, qos=qos, retain=retain)
            self.traffic.add("tx", kind, len(frame))
            return
        if retain:
            raise LimitError(
                f"{kind} on {topic}: a {len(frame)}-byte frame would be chunked, "
                "and chunked messages cannot be retained"
            )
        self._send_chunked(topic, kind, round, frame, qos)

    def seal(self, unsigned: bytes) -> bytes:
        """An unsigned frame as this endpoint publishes it: signed, if it signs."""
        return self.signer.sign(unsigned) if self.signer is not None else unsigned

    def _frame_limit(self, topic: str) -> int:
        limit = self.chunking.threshold
        broker_max = self.transport.max_packet_size
        if broker_max is not None:
            limit = min(limit, broker_max - MQTT_HEADROOM - len(topic.encode()))
        return limit

    def _chunk_frame(self, chunk: Chunk, round: int) -> bytes:
        env = Envelope(body=chunk, sender=self.sender, federation=self.federation, round=round)
        return self.seal(encode(env))

    def _piece_size(self, frame_len: int, limit: int, round: int) -> int:
        # Measure, not guess, what a chunk envelope (and its signature) adds around the data:
        # the largest index/count and the exact total size, with 8 bytes for the bin header.
        probe = Chunk(
            digest=bytes(32), index=frame_len - 1, count=frame_len, total_size=frame_len, data=b""
        )
        piece = limit - len(self._chunk_frame(probe, round)) - 8
        if piece < 1024:
            raise LimitError(
                f"chunk frames of at most {limit} bytes leave only {piece} bytes of data"
            )
        return piece

    def _send_chunked(self, topic: str, kind: str, round: int, frame: bytes, qos: int) -> None:
        """Publish ``frame`` (a message for ``topic``) as chunk frames on ``topic``'s chunk
        topic (:meth:`Topics.chunk_topic`), keeping it to answer chunk requests."""
        self._listen_for_requests(topic)
        chunk_topic = self.topics.chunk_topic(topic)
        piece = self._piece_size(len(frame), self._frame_limit(chunk_topic), round)
        chunks = split_frame(frame, piece)
        self._sent.put(SentFrame(topic, qos, round, kind, frame, piece, chunks[0].digest))
        total = 0
        try:
            for chunk in chunks:
                data = self._chunk_frame(chunk, round)
                self.transport.publish(chunk_topic, data, qos=qos)
                total += len(data)
        finally:  # count what reached the transport, even if a later chunk failed
            self.traffic.add("tx", kind, total, chunks=len(chunks))
        self.log.debug(
            "sent %s to %s as %d chunks (%d bytes)", kind, chunk_topic, len(chunks), total
        )

    def _listen_for_requests(self, topic: str) -> None:
        flt = request_filter(self.topics, topic)
        if flt is None or flt in self._request_filters:
            return
        self._request_filters.add(flt)
        self.transport.subscribe(flt, self._on_bytes, 1)

    # -- receiving -------------------------------------------------------------------------

    def subscribe(self, topic_filter: str, handler: EnvelopeHandler, qos: int = 1) -> None:
        """Deliver valid, first-seen envelopes matching ``topic_filter`` to ``handler``.

        Chunks and chunk requests are handled inside the endpoint; handlers see whole
        messages only. Handlers run on the transport's thread and must not block.
        """
        self.deliver_locally(topic_filter, handler)
        self.transport.subscribe(topic_filter, self._on_bytes, qos)

    def deliver_locally(self, topic_filter: str, handler: EnvelopeHandler) -> None:
        """Route envelopes on topics matching ``topic_filter`` to ``handler`` without
        subscribing to them: for frames that reach this endpoint through :meth:`inject`."""
        self._routes.add(topic_filter, handler)

    def _on_bytes(self, topic: str, data: bytes) -> None:
        if not data:  # an empty retained message clears a topic; nothing to deliver
            return
        env = self._open(topic, data)
        if env is None:
            return
        message_topic = self.topics.message_topic(topic)  # None unless a chunk topic
        if isinstance(env.body, Chunk):
            if message_topic is None and self.topics.chunk_topic(topic) != topic:
                wrong = f"a chunk frame on {topic}: a device message's chunks travel on "
                self._reject(ProtocolError(wrong + f"{topic}/{CHUNKS}"), topic, len(data))
                return
            # reassembled, requested and delivered under the topic of the message
            self._on_chunk(env, env.body, message_topic or topic, len(data))
            return
        if message_topic is not None:
            wrong = f"a {env.kind} frame on the chunk topic {topic}: only chunk frames travel there"
            self._reject(ProtocolError(wrong), topic, len(data))
            return
        self.traffic.add("rx", env.kind, len(data))
        self._deliver(env, topic)

    def _open(
        self, topic: str, data: bytes, *, count: bool = True, received: int = 0
    ) -> Envelope | None:
        """Verify and decode one frame; count and log a rejection instead of raising.

        ``count=False`` for reassembled frames, whose bytes were counted chunk by chunk;
        ``received``: the bytes counted for it (default: the frame's).
        """
        received = received or len(data)
        try:
            obj = decode_frame_map(data, self.limits)
            if "sm" in obj:
                if self.verifier is None:
                    raise SignatureError(
                        f"signed frame (key {obj.get('kid')!r}) but this endpoint has no verifier"
                    )
                env = self.verifier.open(obj, self.limits)
                return replace(env, wire=obj["sm"], verified=True, received=received)
            if self.require_signatures and obj.get("k") not in self.unsigned_kinds:
                raise SignatureError(
                    f"unsigned {obj.get('k')!r} frame from {obj.get('s')!r}: "
                    "signatures are required"
                )
            return envelope_from_map(obj, wire=bytes(data), received=received)
        except ProtocolError as exc:
            self._reject(exc, topic, len(data) if count else 0)
            return None

    def refuse(self, env: Envelope) -> None:
        """A handler refused ``env``, received here: its bytes count as refused, not as
        traffic (a flood of forgeries must not inflate a step's byte figures)."""
        if env.received:
            self.traffic.refuse("rx", env.kind, env.received)

    def trusted(self, env: Envelope) -> bool:
        """Whether a handler may act on ``env`` as evidence: its signature verified, or this
        endpoint does not require signatures. An unsigned frame of ``unsigned_kinds`` (a last
        will) is a hint only: presence, never a state change that needs its sender."""
        return env.verified or not self.require_signatures

    def _reject(self, exc: ProtocolError, topic: str, size: int) -> None:
        reason = type(exc).__name__
        self.rejected[reason] += 1
        if size:
            self.traffic.refuse("rx", INVALID, size, counted=False)
        self.refusals(reason, "rejected a frame on %s: %s", topic, exc)

    def _deliver(self, env: Envelope, topic: str) -> None:
        if self._is_duplicate(env):
            self.rejected["duplicate"] += 1
            self.log.debug("duplicate %s %s from %s", env.kind, env.msg_id, env.sender)
            if self.on_duplicate is not None and not isinstance(env.body, ChunkRequest):
                self._call(self.on_duplicate, env, topic)
            return
        if isinstance(env.body, ChunkRequest):
            self._on_chunk_request(env.body, env.sender)
            return
        for handler in self._routes.handlers(topic):
            self._call(handler, env, topic)

    def _call(self, handler: EnvelopeHandler, env: Envelope, topic: str) -> None:
        try:
            handler(env, topic)
        except Exception:  # one failing handler must not starve the others
            self.log.exception("handler for %s on %s failed", env.kind, topic)

    def _is_duplicate(self, env: Envelope) -> bool:
        key = (env.sender, env.msg_id)
        with self._seen_lock:
            if key in self._seen:
                return True
            self._seen[key] = None
            if len(self._seen) > self._dedupe_window:
                self._seen.popitem(last=False)
        return False

    def close(self) -> None:
        """Stop the background chunk sweeper (the transport is closed by its owner)."""
        self._stop.set()
        sweeper = self._sweeper
        if sweeper is not None and sweeper is not threading.current_thread():
            sweeper.join(timeout=5)
