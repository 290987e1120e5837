"""MQTT 3.1.1 packets as bytes: the few the toolkit speaks, built and parsed without a library.

Used by :mod:`protocol.transport.lean_mqtt` (the coordinator's socket client) and by the benchmarks'
raw broker probes, so both speak exactly the same bytes. Only what edgefl needs: CONNECT
(will, credentials, clean session), PUBLISH at QoS 0/1, PUBACK, SUBSCRIBE, PINGREQ and
DISCONNECT out; CONNACK, PUBLISH, PUBACK, SUBACK and PINGRESP in. No QoS 2.
"""

from __future__ import annotations

import struct

__all__ = [
    "CONNACK",
    "CONNACK_REASONS",
    "CONNECT",
    "DISCONNECT",
    "DISCONNECT_PACKET",
    "PINGREQ",
    "PINGREQ_PACKET",
    "PINGRESP",
    "PUBACK",
    "PUBLISH",
    "SUBACK",
    "SUBSCRIBE",
    "connect_packet",
    "parse_packet",
    "puback_packet",
    "publish_packet",
    "subscribe_packet",
    "utf8",
    "varint",
]

CONNECT, CONNACK, PUBLISH, PUBACK = 1, 2, 3, 4
SUBSCRIBE, SUBACK, PINGREQ, PINGRESP, DISCONNECT = 8, 9, 12, 13, 14
PINGREQ_PACKET = b"\xc0\x00"
DISCONNECT_PACKET = b"\xe0\x00"
MAX_REMAINING = 268_435_455  # the largest remaining length four varint bytes can say

#: CONNACK return codes of MQTT 3.1.1 (§3.2.2.3).
CONNACK_REASONS = {
    1: "unacceptable protocol version",
    2: "identifier rejected",
    3: "server unavailable",
    4: "bad user name or password",
    5: "not authorized",
}


def varint(n: int) -> bytes:
    """The remaining-length encoding (1-4 bytes, 7 bits each, low first)."""
    if not 0 <= n <= MAX_REMAINING:
        raise ValueError(f"MQTT remaining length must be 0..{MAX_REMAINING}, got {n}")
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def utf8(text: str) -> bytes:
    """A length-prefixed UTF-8 string."""
    raw = text.encode()
    if len(raw) > 0xFFFF:
        raise ValueError(f"MQTT string longer than 65535 bytes: {text[:40]!r}...")
    return struct.pack("!H", len(raw)) + raw


def publish_packet(
    topic: str, payload: bytes, qos: int, pid: int = 0, *, retain: bool = False, dup: bool = False
) -> bytes:
    """One PUBLISH packet; ``pid`` is used at QoS 1 only."""
    name = topic.encode()
    head = struct.pack("!H", len(name)) + name + (struct.pack("!H", pid) if qos else b"")
    flags = qos << 1 | int(retain) | (0x08 if dup else 0)
    return b"".join(
        (bytes([PUBLISH << 4 | flags]), varint(len(head) + len(payload)), head, payload)
    )


def puback_packet(pid: int) -> bytes:
    """The PUBACK of packet id ``pid``."""
    return struct.pack("!BBH", PUBACK << 4, 2, pid)


def connect_packet(
    client_id: str,
    *,
    keepalive: int,
    clean_session: bool,
    will: tuple[str, bytes, int, bool] | None = None,
    username: str | None = None,
    password: str | None = None,
) -> bytes:
    """CONNECT for MQTT 3.1.1; ``will`` is ``(topic, payload, qos, retain)``."""
    flags = 0x02 if clean_session else 0
    body = [utf8("MQTT"), b"\x04", b"", struct.pack("!H", keepalive), utf8(client_id)]
    if will is not None:
        topic, message, qos, retain = will
        flags |= 0x04 | qos << 3 | (0x20 if retain else 0)
        body += [utf8(topic), struct.pack("!H", len(message)), message]
    if username is not None:
        flags |= 0x80
        body.append(utf8(username))
        if password is not None:
            flags |= 0x40
            body.append(utf8(password))
    body[2] = bytes([flags])
    raw = b"".join(body)
    return bytes([CONNECT << 4]) + varint(len(raw)) + raw


def subscribe_packet(pid: int, filters: list[tuple[str, int]]) -> bytes:
    """SUBSCRIBE to ``filters`` (``(filter, qos)`` pairs) under packet id ``pid``."""
    raw = struct.pack("!H", pid) + b"".join(utf8(f) + bytes([q]) for f, q in filters)
    return bytes([SUBSCRIBE << 4 | 0x2]) + varint(len(raw)) + raw


def parse_packet(buf: bytes | bytearray, pos: int = 0) -> tuple[int, int, int, int] | None:
    """``(type, flags, body start, body end)`` of the packet at ``pos``; None if incomplete.

    Raises:
        ValueError: a remaining length longer than four bytes (not MQTT).
    """
    size = len(buf)
    if size < pos + 2:
        return None
    head = buf[pos]
    length, shift, i = 0, 0, pos + 1
    while True:
        if i >= size:
            return None
        byte = buf[i]
        length |= (byte & 0x7F) << shift
        i += 1
        if not byte & 0x80:
            break
        shift += 7
        if shift > 21:
            raise ValueError("malformed MQTT packet: remaining length over four bytes")
    if size < i + length:
        return None
    return head >> 4, head & 0x0F, i, i + length
