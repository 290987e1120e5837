"""Splitting large frames into :class:`~protocol.contract.messages.Chunk` messages and reassembling
them.

A frame (signed or not) longer than the chunk threshold travels as ``count`` chunk envelopes on
the message's chunk topic (:meth:`~protocol.contract.topics.Topics.chunk_topic`: ``{topic}/chunk``
for a
device's up or down topic, the topic itself elsewhere), each carrying
``data = frame[index * piece : (index + 1) * piece]`` and the SHA-256 ``digest`` of the whole
frame. The receiver (:class:`Reassembler`) accepts chunks in any order, ignores duplicates,
checks the declared ``total_size`` against the hard cap before it keeps anything, bounds how
many partial messages and how many bytes it holds, asks for missing chunks when a partial
stalls and drops it after a timeout. Budgets are per sender (declared sizes) and global (bytes
actually held), so one sender's announcements cannot starve the others. The sender
keeps recently chunked frames in a :class:`SentCache` to answer
:class:`~protocol.contract.messages.ChunkRequest`. See ``WIRE.md`` §Chunking.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol.contract.messages import Chunk
from protocol.contract.topics import Topics
from protocol.errors import ConfigError, DecodeError, LimitError, ValidationError

__all__ = [
    "DEFAULT_CHUNK_POLICY",
    "ChunkPolicy",
    "Reassembler",
    "SentCache",
    "SentFrame",
    "Stalled",
    "request_topic",
    "split_frame",
]

MIN_PIECE = 1024  # below this the per-chunk envelope would dominate the bytes on the wire
MAX_MISSING_PER_REQUEST = 4096


@dataclass(frozen=True, slots=True)
class ChunkPolicy:
    """How an :class:`~protocol.transport.endpoint.Endpoint` chunks what it sends and reassembles.

    Attributes:
        threshold: Largest frame sent whole, in bytes; larger frames are chunked so that every
            chunk frame is at most this long. Lowered automatically to the broker's maximum
            packet size when the transport knows it.
        request_after: Seconds without a new chunk before the receiver asks for missing ones.
        max_requests: Chunk requests per partial message before giving up on it.
        partial_timeout: Seconds without a new chunk before a partial message is dropped.
        max_partials: Partial messages held at once (per endpoint). When full, a new message
            evicts the partial that has gone longest without a new chunk. Sized for a fleet
            answering at once: every device's chunked reply is partial at the same time (a broker
            interleaves them, chunk 0 of many replies before chunk 1); at 64, 100 devices'
            1 MB replies evict each other and the run stalls.
            Memory is bounded by the byte budgets below, one sender's share by its own.
        max_partial_bytes: Data bytes actually held in partial messages (per endpoint); a
            chunk that would exceed it evicts the stalest other partials. A message declaring
            more than this can never complete and is refused.
        max_sender_partials: Partial messages held at once from one sender; its next one
            evicts its own stalest partial, never another sender's.
        max_sender_bytes: Sum of the declared sizes of one sender's partial messages; a new
            message beyond it evicts that sender's stalest partials. Announcing sizes costs a
            sender only its own budget, never the others'.
        sent_cache_bytes: Recently chunked frames the sender keeps to answer chunk requests.
        completed_memory: Completed digests remembered to recognise late duplicate chunks.
        sweep_interval: Seconds between background checks for stalled partials; ``None`` runs
            no background thread (call ``Endpoint.sweep_chunks()`` yourself, e.g. in tests).
    """

    threshold: int = 256 * 1024
    request_after: float = 2.0
    max_requests: int = 3
    partial_timeout: float = 60.0
    max_partials: int = 1024
    max_partial_bytes: int = 256 * 1024 * 1024
    max_sender_partials: int = 8
    max_sender_bytes: int = 128 * 1024 * 1024
    sent_cache_bytes: int = 64 * 1024 * 1024
    completed_memory: int = 4096
    sweep_interval: float | None = 0.5

    def __post_init__(self) -> None:
        if self.threshold < 2 * MIN_PIECE:
            raise ConfigError(
                f"chunk threshold: expected >= {2 * MIN_PIECE} bytes, got {self.threshold}"
            )
        if not 0 < self.request_after <= self.partial_timeout:
            raise ConfigError(
                "chunk timeouts: expected 0 < request_after <= partial_timeout, got "
                f"{self.request_after} and {self.partial_timeout}"
            )
        if min(self.max_partials, self.max_sender_partials) < 1:
            raise ConfigError(
                "chunk partial limits: expected max_partials and max_sender_partials >= 1, got "
                f"{self.max_partials} and {self.max_sender_partials}"
            )
        if self.sweep_interval is not None and self.sweep_interval <= 0:
            raise ConfigError(
                f"chunk sweep_interval: expected > 0 or None, got {self.sweep_interval}"
            )


DEFAULT_CHUNK_POLICY = ChunkPolicy()


def split_frame(frame: bytes, piece: int) -> list[Chunk]:
    """Cut ``frame`` into chunks of at most ``piece`` data bytes, addressed by its SHA-256."""
    if piece < 1:
        raise ConfigError(f"chunk piece size: expected >= 1 byte, got {piece}")
    digest = hashlib.sha256(frame).digest()
    count = -(-len(frame) // piece)
    view = memoryview(frame)
    return [
        Chunk(
            digest=digest,
            index=i,
            count=count,
            total_size=len(frame),
            data=bytes(view[i * piece : (i + 1) * piece]),
        )
        for i in range(count)
    ]


def request_topic(topics: Topics, chunk_topic: str, requester: str) -> str | None:
    """Where the receiver of chunks on ``chunk_topic`` publishes its ChunkRequest.

    The request goes back along the path the chunks came, on the topics each side may write
    under the broker ACL: chunks an agent sent on ``dev/{id}/up/*`` are requested on
    ``dev/{id}/down/chunk_req``; chunks the coordinator sent on ``dev/{id}/down/*`` or
    ``bcast/*`` are requested on ``dev/{requester}/up/chunk_req``. Other topics carry no bulk
    data, so ``None``.
    """
    parts = chunk_topic.split("/")
    base = topics.base.split("/")
    if parts[: len(base)] != base:
        return None
    rest = parts[len(base) :]
    try:
        if len(rest) >= 4 and rest[0] == "dev" and rest[2] == "up":
            return topics.down(rest[1], "chunk_req")
        if len(rest) >= 4 and rest[0] == "dev" and rest[2] == "down":
            return topics.up(rest[1], "chunk_req")
        if len(rest) >= 2 and rest[0] == "bcast":
            return topics.up(requester, "chunk_req")
    except ValidationError:  # requester or device id not usable as a topic level
        return None
    return None


def request_filter(topics: Topics, chunk_topic: str) -> str | None:
    """The filter on which the sender of chunks on ``chunk_topic`` hears requests for them."""
    parts = chunk_topic.split("/")
    base = topics.base.split("/")
    if parts[: len(base)] != base:
        return None
    rest = parts[len(base) :]
    if len(rest) >= 4 and rest[0] == "dev" and rest[2] == "up":
        return topics.down(rest[1], "chunk_req")
    if (len(rest) >= 4 and rest[0] == "dev" and rest[2] == "down") or (
        len(rest) >= 2 and rest[0] == "bcast"
    ):
        return f"{topics.base}/dev/+/up/chunk_req"
    return None


@dataclass(frozen=True, slots=True)
class SentFrame:
    """A chunked frame kept by its sender: enough to rebuild any of its chunks."""

    topic: str
    qos: int
    round: int
    kind: str  # kind of the inner message, for byte accounting of resent chunks
    frame: bytes
    piece: int
    digest: bytes

    def chunk(self, index: int) -> Chunk:
        """Chunk ``index`` of this frame, identical in content to the one first sent."""
        return Chunk(
            digest=self.digest,
            index=index,
            count=self.count,
            total_size=len(self.frame),
            data=self.frame[index * self.piece : (index + 1) * self.piece],
        )

    @property
    def count(self) -> int:
        """Number of chunks."""
        return -(-len(self.frame) // self.piece)


class SentCache:
    """Recently chunked frames by digest, bounded by total bytes (oldest evicted first)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._frames: OrderedDict[bytes, SentFrame] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, sent: SentFrame) -> None:
        """Remember ``sent``; frames larger than the whole cache are not kept."""
        digest, size = sent.digest, len(sent.frame)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._frames.pop(digest, None)
            if old is not None:
                self._bytes -= len(old.frame)
            self._frames[digest] = sent
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, evicted = self._frames.popitem(last=False)
                self._bytes -= len(evicted.frame)

    def get(self, digest: bytes) -> SentFrame | None:
        """The frame with this digest, if still cached."""
        with self._lock:
            return self._frames.get(digest)


@dataclass
class _Partial:
    sender: str
    topic: str
    count: int
    total_size: int
    pieces: dict[int, bytes] = field(default_factory=dict)
    received: int = 0  # data bytes held
    wire_bytes: int = 0  # encoded chunk frames seen, duplicates included (byte accounting)
    frames: int = 0
    last_progress: float = 0.0
    requests: int = 0


@dataclass(frozen=True, slots=True)
class Stalled:
    """A partial message for which missing chunks should be requested, or that was dropped."""

    sender: str
    topic: str
    digest: bytes
    missing: list[int]
    wire_bytes: int
    reason: str = ""  # why it was evicted (evictions only)


class Reassembler:
    """Collects chunks per ``(sender, digest)`` and returns whole frames once verified.

    Thread-safe: chunks arrive on the transport thread, sweeps run on a timer thread. Partials
    evicted to make room for others are kept for :meth:`take_evicted`.
    """

    def __init__(
        self, policy: ChunkPolicy, max_message: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.policy = policy
        self.max_message = max_message
        self.clock = clock
        self._partials: dict[tuple[str, bytes], _Partial] = {}
        self._held = 0  # data bytes held in partials (what has actually arrived)
        self._done: OrderedDict[tuple[str, bytes], str] = OrderedDict()  # -> inner kind
        self._evicted: list[Stalled] = []
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        """Partial messages currently held."""
        return len(self._partials)

    @property
    def held_bytes(self) -> int:
        """Data bytes currently held in partial messages."""
        return self._held

    def take_evicted(self) -> list[Stalled]:
        """Partials evicted to make room since the last call (to log and count them)."""
        with self._lock:
            evicted, self._evicted = self._evicted, []
        return evicted

    def add(
        self, chunk: Chunk, sender: str, topic: str, wire_bytes: int
    ) -> tuple[bytes, int, int] | None:
        """Take one chunk; when complete, return ``(frame, wire bytes, chunk frames)``.

        The byte and frame counts cover every chunk frame of the message seen so far,
        duplicates included.

        Returns ``None`` while incomplete and for duplicates (including chunks of a message
        already completed, see :meth:`late_kind`).

        Raises:
            LimitError: the declared size exceeds the hard cap or a budget it can never fit,
                or its data cannot be held even after evicting every other partial.
            ValidationError: the chunk contradicts earlier chunks of the same digest.
            DecodeError: the reassembled bytes do not match the digest.
        """
        key = (sender, chunk.digest)
        with self._lock:
            if key in self._done:
                return None
            part = self._partials.get(key)
            if part is None:
                part = self._open(key, chunk, topic)
            elif (chunk.count, chunk.total_size) != (part.count, part.total_size):
                self._drop(key)
                raise ValidationError(
                    "chunk.count/total_size",
                    f"{part.count}/{part.total_size} as earlier chunks",
                    f"{chunk.count}/{chunk.total_size}",
                )
            part.wire_bytes += wire_bytes
            part.frames += 1
            if chunk.index in part.pieces:
                return None
            if part.received + len(chunk.data) > part.total_size:
                self._drop(key)
                raise ValidationError(
                    "chunk.data",
                    f"at most {part.total_size} bytes in all",
                    part.received + len(chunk.data),
                )
            self._make_room(key, len(chunk.data))
            part.pieces[chunk.index] = chunk.data
            part.received += len(chunk.data)
            self._held += len(chunk.data)
            part.last_progress = self.clock()
            if len(part.pieces) < part.count:
                return None
            self._drop(key)
            frame = b"".join(part.pieces[i] for i in range(part.count))
            if len(frame) != part.total_size or hashlib.sha256(frame).digest() != chunk.digest:
                raise DecodeError(
                    f"chunked message {chunk.digest.hex()[:16]} from {sender}: reassembled "
                    f"{len(frame)} bytes do not match the declared size or SHA-256 digest"
                )
            self._done[key] = ""
            while len(self._done) > self.policy.completed_memory:
                self._done.popitem(last=False)
            return frame, part.wire_bytes, part.frames

    def _open(self, key: tuple[str, bytes], chunk: Chunk, topic: str) -> _Partial:
        # Declared sizes are checked before anything is held, but they are only charged to
        # the sender's own budget: the shared budget counts bytes that actually arrived.
        sender, policy = key[0], self.policy
        cap = min(self.max_message, policy.max_partial_bytes, policy.max_sender_bytes)
        if chunk.total_size > cap:
            raise LimitError(
                f"chunk.total_size: {chunk.total_size} bytes exceeds the {cap}-byte cap"
            )
        if chunk.count > chunk.total_size:
            raise ValidationError("chunk.count", f"<= total_size ({chunk.total_size})", chunk.count)
        own = [k for k in self._partials if k[0] == sender]
        declared = sum(self._partials[k].total_size for k in own)
        while own and (
            len(own) >= policy.max_sender_partials
            or declared + chunk.total_size > policy.max_sender_bytes
        ):
            victim = self._stalest(own)
            own.remove(victim)
            declared -= self._partials[victim].total_size
            self._evict(victim, f"sender {sender} opened another message")
        while len(self._partials) >= policy.max_partials:
            self._evict(self._stalest(list(self._partials)), "too many partial messages")
        part = _Partial(
            sender=sender,
            topic=topic,
            count=chunk.count,
            total_size=chunk.total_size,
            last_progress=self.clock(),
        )
        self._partials[key] = part
        return part

    def _make_room(self, key: tuple[str, bytes], size: int) -> None:
        """Evict the stalest other partials until ``size`` more bytes fit the shared budget."""
        others = [k for k in self._partials if k != key]
        while self._held + size > self.policy.max_partial_bytes:
            if not others:
                self._drop(key)
                raise LimitError(
                    f"chunking: {size} more bytes exceed the {self.policy.max_partial_bytes}"
                    "-byte budget for partial messages"
                )
            victim = self._stalest(others)
            others.remove(victim)
            self._evict(victim, "partial-message bytes budget full")

    def _stalest(self, keys: list[tuple[str, bytes]]) -> tuple[str, bytes]:
        return min(keys, key=lambda k: self._partials[k].last_progress)

    def _evict(self, key: tuple[str, bytes], why: str) -> None:
        part = self._drop(key)
        if part is None:
            return
        missing = [i for i in range(part.count) if i not in part.pieces]
        self._evicted.append(
            Stalled(
                part.sender,
                part.topic,
                key[1],
                missing[:MAX_MISSING_PER_REQUEST],
                part.wire_bytes,
                why,
            )
        )

    def _drop(self, key: tuple[str, bytes]) -> _Partial | None:
        part = self._partials.pop(key, None)
        if part is not None:
            self._held -= part.received
        return part

    def mark_kind(self, sender: str, digest: bytes, kind: str) -> None:
        """Record the inner kind of a completed message (attributes late duplicates' bytes)."""
        with self._lock:
            if (sender, digest) in self._done:
                self._done[(sender, digest)] = kind

    def late_kind(self, sender: str, digest: bytes) -> str | None:
        """Inner kind of an already completed message, ``""`` if unknown, else ``None``."""
        with self._lock:
            return self._done.get((sender, digest))

    def sweep(self, now: float | None = None) -> tuple[list[Stalled], list[Stalled]]:
        """Find stalled partials: ``(to request, dropped)``.

        A partial with no new chunk for ``request_after`` seconds is returned for a request
        (at most ``max_requests`` times, spaced by ``request_after``); one with no new chunk
        for ``partial_timeout`` seconds, or out of requests, is dropped.
        """
        now = self.clock() if now is None else now
        requests: list[Stalled] = []
        dropped: list[Stalled] = []
        with self._lock:
            for key, part in list(self._partials.items()):
                idle = now - part.last_progress
                missing = [i for i in range(part.count) if i not in part.pieces]
                info = Stalled(
                    part.sender,
                    part.topic,
                    key[1],
                    missing[:MAX_MISSING_PER_REQUEST],
                    part.wire_bytes,
                )
                if idle >= self.policy.partial_timeout or (
                    part.requests >= self.policy.max_requests
                    and idle >= self.policy.request_after * (part.requests + 1)
                ):
                    self._drop(key)
                    dropped.append(info)
                elif idle >= self.policy.request_after * (part.requests + 1):
                    part.requests += 1
                    requests.append(info)
        return requests, dropped
