"""The wire contract of edgefl: messages, payloads, codec, topics and transports (no torch)."""

from protocol.contract.chunking import ChunkPolicy
from protocol.contract.codec import Envelope, Limits, decode, encode
from protocol.contract.messages import (
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
from protocol.contract.payloads import FeatureLogitSet, ImageVectorPairs, PrototypeSet, TensorMap
from protocol.contract.topics import Topics
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
from protocol.security.signing import HmacSigner, Signer, Verifier
from protocol.transport.base import MemoryBroker, MemoryTransport, Transport, Will
from protocol.transport.endpoint import Endpoint
from protocol.transport.traffic import TrafficCounter

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
