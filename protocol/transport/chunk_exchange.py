"""The receiving side of chunked messages for an :class:`~protocol.transport.endpoint.Endpoint`:
reassembly, answering chunk requests with the chunks kept of sent messages, and the sweeper
that requests missing chunks of stalled messages and drops expired ones."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import TYPE_CHECKING

from protocol.contract.chunking import ChunkPolicy, Reassembler, SentCache, request_topic
from protocol.contract.codec import Envelope
from protocol.contract.messages import Chunk, ChunkRequest, Message
from protocol.contract.topics import Topics
from protocol.errors import ProtocolError, TransportError
from protocol.transport.base import Transport
from protocol.transport.traffic import TrafficCounter

__all__ = ["ChunkExchange"]


class ChunkExchange:
    """The chunk handling that :class:`~protocol.transport.endpoint.Endpoint` inherits; the
    state it uses is made by ``Endpoint.__init__``."""

    sender: str
    topics: Topics
    chunking: ChunkPolicy
    transport: Transport
    traffic: TrafficCounter
    rejected: Counter[str]
    log: logging.Logger
    _reassembler: Reassembler
    _sent: SentCache
    _sweeper: threading.Thread | None
    _sweeper_lock: threading.Lock
    _stop: threading.Event

    if TYPE_CHECKING:  # the Endpoint's own methods that chunk handling calls

        def send(
            self,
            topic: str,
            body: Message,
            *,
            round: int = 0,
            qos: int = 1,
            retain: bool = False,
            msg_id: str | None = None,
        ) -> Envelope: ...

        def _open(
            self, topic: str, data: bytes, *, count: bool = True, received: int = 0
        ) -> Envelope | None: ...

        def _reject(self, exc: ProtocolError, topic: str, size: int) -> None: ...

        def _deliver(self, env: Envelope, topic: str) -> None: ...

        def _chunk_frame(self, chunk: Chunk, round: int) -> bytes: ...

    def _on_chunk(self, env: Envelope, chunk: Chunk, topic: str, size: int) -> None:
        late = self._reassembler.late_kind(env.sender, chunk.digest)
        if late is not None:  # a duplicate of a message already delivered
            self.traffic.add("rx", late or "chunk", size, messages=0, chunks=1)
            return
        self.traffic.add("rx", "chunk", size, messages=0, chunks=1)
        try:
            done = self._reassembler.add(chunk, env.sender, topic, size)
        except ProtocolError as exc:
            self._reject(exc, topic, 0)
            return
        finally:
            self._log_evicted()
        self._ensure_sweeper()
        if done is None:
            return
        frame, wire_bytes, frames = done
        inner = self._open(topic, frame, count=False, received=wire_bytes)
        if inner is None:
            return
        if isinstance(inner.body, Chunk) or inner.sender != env.sender:
            self._reject(
                ProtocolError(
                    f"chunked message from {env.sender} carries a {inner.kind} from {inner.sender}"
                ),
                topic,
                0,
            )
            return
        self._reassembler.mark_kind(env.sender, chunk.digest, inner.kind)
        self.traffic.move("rx", "chunk", inner.kind, wire_bytes, chunks=frames)
        self._deliver(inner, topic)

    def _log_evicted(self) -> None:
        for part in self._reassembler.take_evicted():
            self.rejected["evicted"] += 1
            self.log.warning(
                "evicted incomplete message %s from %s on %s (%d chunks missing): %s",
                part.digest.hex()[:16],
                part.sender,
                part.topic,
                len(part.missing),
                part.reason,
            )

    def _on_chunk_request(self, req: ChunkRequest, requester: str) -> None:
        sent = self._sent.get(req.digest)
        if sent is None:
            self.log.info(
                "chunk request from %s for unknown or evicted %s", requester, req.digest.hex()[:16]
            )
            return
        indices = sorted({i for i in req.missing if 0 <= i < sent.count})
        total = 0
        try:
            for i in indices:
                data = self._chunk_frame(sent.chunk(i), sent.round)
                self.transport.publish(self.topics.chunk_topic(sent.topic), data, qos=sent.qos)
                total += len(data)
        except TransportError as exc:
            self.log.warning("resending chunks of %s failed: %s", req.digest.hex()[:16], exc)
        self.traffic.add("tx", sent.kind, total, messages=0, chunks=len(indices))
        self.log.info(
            "resent %d chunks of %s to %s", len(indices), req.digest.hex()[:16], requester
        )

    def sweep_chunks(self, now: float | None = None) -> None:
        """Request missing chunks of stalled partial messages and drop expired ones.

        Runs every ``chunking.sweep_interval`` seconds on a background thread while partial
        messages exist; call it directly when ``sweep_interval`` is ``None``.
        """
        requests, dropped = self._reassembler.sweep(now)
        for part in dropped:
            self.rejected["incomplete"] += 1
            self.log.warning(
                "dropped incomplete message %s from %s on %s (%d chunks missing)",
                part.digest.hex()[:16],
                part.sender,
                part.topic,
                len(part.missing),
            )
        for part in requests:
            target = request_topic(self.topics, part.topic, self.sender)
            if target is None:
                self.log.info("no request topic for chunks on %s; waiting", part.topic)
                continue
            try:
                self.send(target, ChunkRequest(digest=part.digest, missing=part.missing))
            except TransportError as exc:
                self.log.warning("chunk request on %s failed: %s", target, exc)

    def _ensure_sweeper(self) -> None:
        interval = self.chunking.sweep_interval
        if interval is None:
            return
        with self._sweeper_lock:
            if self._sweeper is not None and self._sweeper.is_alive():
                return
            self._sweeper = threading.Thread(
                target=self._sweep_loop,
                args=(interval,),
                name=f"edgefl-chunks-{self.sender}",
                daemon=True,
            )
            self._sweeper.start()

    def _sweep_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.sweep_chunks()
            except Exception:  # keep sweeping; a failure here must not leak partials
                self.log.exception("chunk sweep failed")
            if self._reassembler.pending == 0:
                with self._sweeper_lock:
                    if self._reassembler.pending == 0:
                        self._sweeper = None
                        return
