"""One exception hierarchy for the whole toolkit, rooted in :class:`EdgeFLError`.

Every rejection names what was wrong: the field, what was expected and what arrived, so that a
log line is enough to find the bad sender or the bad file.
"""

from __future__ import annotations

__all__ = [
    "AdmissionError",
    "AggregationError",
    "ConfigError",
    "ConnectError",
    "DecodeError",
    "EdgeFLError",
    "ExportError",
    "LimitError",
    "ProtocolError",
    "SignatureError",
    "TransportError",
    "ValidationError",
]


class EdgeFLError(Exception):
    """Root of every error raised on purpose by edgefl."""


class ProtocolError(EdgeFLError):
    """A message could not be accepted (undecodable, unknown kind, invalid field, bad signature)."""


class DecodeError(ProtocolError):
    """The bytes are not a well-formed message of this protocol."""


class ValidationError(ProtocolError):
    """A field holds a value of the wrong type, shape, dtype or range."""

    def __init__(self, field: str, expected: str, got: object) -> None:
        self.field = field
        self.expected = expected
        self.got = got
        shown = repr(got)
        if len(shown) > 120:
            shown = shown[:117] + "..."
        super().__init__(f"{field}: expected {expected}, got {shown}")


class LimitError(ProtocolError):
    """A message or one of its parts exceeds a configured size limit."""


class SignatureError(ProtocolError):
    """A signature is missing, invalid, stale or replayed."""


class TransportError(EdgeFLError):
    """The message transport failed (broker lost, publish refused)."""


class ConnectError(TransportError):
    """The broker could not be reached."""


class AggregationError(EdgeFLError):
    """Replies could not be aggregated (inconsistent shapes, no valid replies)."""


class AdmissionError(EdgeFLError):
    """An agent may not join this run; ``reason`` is sent to it so that it stops waiting."""

    def __init__(self, device_id: str, reason: str) -> None:
        self.device_id = device_id
        self.reason = reason
        super().__init__(f"agent {device_id} refused: {reason}")


class ConfigError(EdgeFLError):
    """A configuration file or option is invalid (unknown key, wrong type, missing file)."""


class ExportError(EdgeFLError):
    """A model could not be exported or its export did not verify."""
