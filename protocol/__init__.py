"""The wire contract of edgefl: messages, payloads, codec, topics and transports (no torch)."""

from protocol.chunking import ChunkPolicy
from protocol.codec import Envelope, Limits, decode, encode
from protocol.endpoint import Endpoint, TrafficCounter
from protocol.errors import (
    ConfigError,
    DecodeError,
    EdgeFLError,
    LimitError,
    ProtocolError,
    SignatureError,
    TransportError,
    ValidationError,
)
from protocol.messages import (
    MESSAGE_TYPES,
    Ack,
    Capabilities,
    Chunk,
    ChunkRequest,
    CoordinatorState,
    ErrorReply,
    InputSpec,
    Progress,
    Register,
    Reply,
    RoundDescriptor,
    Status,
    Task,
)
from protocol.payloads import FeatureLogitSet, ImageVectorPairs, PrototypeSet, TensorMap
from protocol.signing import HmacSigner, Signer, Verifier
from protocol.topics import Topics
from protocol.transport import MemoryBroker, MemoryTransport, Transport, Will

__all__ = [
    "MESSAGE_TYPES",
    "Ack",
    "Capabilities",
    "Chunk",
    "ChunkPolicy",
    "ChunkRequest",
    "ConfigError",
    "CoordinatorState",
    "DecodeError",
    "EdgeFLError",
    "Endpoint",
    "Envelope",
    "ErrorReply",
    "FeatureLogitSet",
    "HmacSigner",
    "ImageVectorPairs",
    "InputSpec",
    "LimitError",
    "Limits",
    "MemoryBroker",
    "MemoryTransport",
    "Progress",
    "ProtocolError",
    "PrototypeSet",
    "Register",
    "Reply",
    "RoundDescriptor",
    "SignatureError",
    "Signer",
    "Status",
    "Task",
    "TensorMap",
    "Topics",
    "TrafficCounter",
    "Transport",
    "TransportError",
    "ValidationError",
    "Verifier",
    "Will",
    "decode",
    "encode",
]
