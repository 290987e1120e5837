"""Optional end-to-end message signatures: HMAC-SHA256 per device key, or Ed25519.

A signed frame wraps the exact bytes of an unsigned frame (``WIRE.md`` §Signed frame)::

    {"v": 1, "sm": <bin: unsigned frame>, "g": <bin: signature over sm>, "kid": <key id>}

The key id is the sender's id: a verifier accepts a frame only if ``kid`` names a key it knows,
the signature over ``sm`` verifies with that key, the inner envelope's sender equals ``kid``
(so a device cannot speak for another, even through a compromised broker), its timestamp is
within ``window`` seconds of the verifier's clock, and ``(sender, msg_id)`` was not accepted
before (replay cache). The algorithm is fixed by the verifier's key, never read from the frame.

HMAC needs only the standard library. Ed25519 uses the ``cryptography`` package, imported
only when an Ed25519 key is created.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import msgpack

from protocol.contract.codec import (
    SCHEMA_VERSION,
    Envelope,
    Limits,
    decode_frame_map,
    envelope_from_map,
)
from protocol.errors import ConfigError, DecodeError, SignatureError, ValidationError

__all__ = [
    "DEFAULT_WINDOW",
    "Ed25519Signer",
    "Ed25519VerifyKey",
    "HmacKey",
    "HmacSigner",
    "Signer",
    "Verifier",
    "VerifyKey",
]

DEFAULT_WINDOW = 300.0
MIN_HMAC_KEY = 16
_SIGNED_KEYS = frozenset({"v", "sm", "g", "kid"})
_LIMITS = Limits()


def _cryptography_ed25519() -> Any:
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:
        raise ConfigError(
            "Ed25519 signatures need the 'cryptography' package: pip install edgefl[signing] "
            "(or use HMAC-SHA256 keys, which need nothing extra)"
        ) from exc
    return ed25519


def _check_kid(key_id: str) -> None:
    if not isinstance(key_id, str) or not 0 < len(key_id) <= 128:
        raise ConfigError(f"key id: expected 1..128 characters (the sender id), got {key_id!r}")


class Signer(ABC):
    """Signs outgoing frames with one key; ``key_id`` must be the sending endpoint's id."""

    algorithm: ClassVar[str] = ""

    def __init__(self, key_id: str) -> None:
        _check_kid(key_id)
        self.key_id = key_id

    @abstractmethod
    def signature(self, message: bytes) -> bytes:
        """The raw signature of ``message``."""

    def sign(self, frame: bytes) -> bytes:
        """Wrap an unsigned ``frame`` into a signed frame."""
        wrapped = {"v": SCHEMA_VERSION, "sm": frame, "g": self.signature(frame), "kid": self.key_id}
        return msgpack.packb(wrapped, use_bin_type=True)  # type: ignore[no-any-return]


class VerifyKey(ABC):
    """Checks signatures made with one sender's key."""

    algorithm: ClassVar[str] = ""

    @abstractmethod
    def verify(self, message: bytes, signature: bytes) -> bool:
        """Whether ``signature`` is valid for ``message``."""


def _hmac_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) < MIN_HMAC_KEY:
        got = f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__
        raise ConfigError(f"HMAC key: expected at least {MIN_HMAC_KEY} random bytes, got {got}")
    return key


class HmacSigner(Signer):
    """HMAC-SHA256 with a secret shared between one device and the coordinator."""

    algorithm: ClassVar[str] = "hmac-sha256"

    def __init__(self, key_id: str, key: bytes) -> None:
        super().__init__(key_id)
        self._key = _hmac_key(key)

    def signature(self, message: bytes) -> bytes:
        """32-byte HMAC-SHA256 tag."""
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def verify_key(self) -> HmacKey:
        """The matching verification key (the same secret)."""
        return HmacKey(self._key)


class HmacKey(VerifyKey):
    """Verification side of :class:`HmacSigner`."""

    algorithm: ClassVar[str] = "hmac-sha256"

    def __init__(self, key: bytes) -> None:
        self._key = _hmac_key(key)

    def verify(self, message: bytes, signature: bytes) -> bool:
        """Constant-time comparison of the expected and received tags."""
        expected = hmac.new(self._key, message, hashlib.sha256).digest()
        return hmac.compare_digest(expected, signature)


class Ed25519Signer(Signer):
    """Ed25519 with a device's private key (32 raw bytes); verifiers hold only the public key."""

    algorithm: ClassVar[str] = "ed25519"

    def __init__(self, key_id: str, private_key: bytes) -> None:
        super().__init__(key_id)
        ed25519 = _cryptography_ed25519()
        try:
            self._key = ed25519.Ed25519PrivateKey.from_private_bytes(private_key)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"Ed25519 private key: expected 32 raw bytes ({exc})") from exc

    @classmethod
    def generate(cls, key_id: str) -> Ed25519Signer:
        """A signer with a fresh random key."""
        ed25519 = _cryptography_ed25519()
        from cryptography.hazmat.primitives import serialization

        raw = ed25519.Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        return cls(key_id, raw)

    def public_key_bytes(self) -> bytes:
        """The 32-byte raw public key to give to verifiers."""
        from cryptography.hazmat.primitives import serialization

        raw: bytes = self._key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        return raw

    def verify_key(self) -> Ed25519VerifyKey:
        """The matching verification key."""
        return Ed25519VerifyKey(self.public_key_bytes())

    def signature(self, message: bytes) -> bytes:
        """64-byte Ed25519 signature."""
        sig: bytes = self._key.sign(message)
        return sig


class Ed25519VerifyKey(VerifyKey):
    """An Ed25519 public key (32 raw bytes)."""

    algorithm: ClassVar[str] = "ed25519"

    def __init__(self, public_key: bytes) -> None:
        ed25519 = _cryptography_ed25519()
        try:
            self._key = ed25519.Ed25519PublicKey.from_public_bytes(public_key)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"Ed25519 public key: expected 32 raw bytes ({exc})") from exc

    def verify(self, message: bytes, signature: bytes) -> bool:
        """Whether the signature verifies under this public key."""
        from cryptography.exceptions import InvalidSignature

        try:
            self._key.verify(signature, message)
        except InvalidSignature:
            return False
        return True


KeyLookup = Mapping[str, VerifyKey] | Callable[[str], "VerifyKey | None"]


class Verifier:
    """Opens signed frames: key by ``kid``, signature, sender, timestamp window, replay cache.

    The replay cache remembers each accepted ``(sender, msg_id)`` for twice the window, which
    is as long as the timestamp check could let its replay through; ``max_entries`` bounds it
    (the oldest are forgotten first, logged by the caller as a rejected count, never silently
    accepted within the window unless the cache overflows).
    """

    def __init__(
        self,
        keys: KeyLookup,
        *,
        window: float = DEFAULT_WINDOW,
        max_entries: int = 200_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if window <= 0:
            raise ConfigError(f"signature window: expected > 0 seconds, got {window}")
        self._keys = keys
        self.window = window
        self.max_entries = max_entries
        self.clock = clock
        self._seen: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._lock = threading.Lock()

    def _lookup(self, kid: str) -> VerifyKey | None:
        if callable(self._keys):
            return self._keys(kid)
        return self._keys.get(kid)

    def verify(self, data: bytes, limits: Limits = _LIMITS) -> Envelope:
        """Decode and verify a signed frame's bytes.

        Raises:
            SignatureError: unsigned, unknown key, bad signature, wrong sender, stale, replayed.
            DecodeError, ValidationError: the frame or the inner message is malformed.
        """
        obj = decode_frame_map(data, limits)
        if "sm" not in obj:
            raise SignatureError(f"unsigned {obj.get('k')!r} frame from {obj.get('s')!r}")
        return self.open(obj, limits)

    def open(self, obj: dict[str, Any], limits: Limits = _LIMITS) -> Envelope:
        """Verify an already unpacked signed-frame map and return its inner envelope."""
        if set(obj) != _SIGNED_KEYS:
            raise ValidationError(
                "signed frame", f"keys {sorted(_SIGNED_KEYS)}", sorted(map(str, obj))
            )
        inner, sig, kid = obj["sm"], obj["g"], obj["kid"]
        if not isinstance(inner, bytes):
            raise ValidationError("signed frame.sm", "bytes", type(inner).__name__)
        if not isinstance(sig, bytes) or not 0 < len(sig) <= 512:
            raise ValidationError("signed frame.g", "1..512 bytes", type(sig).__name__)
        if not isinstance(kid, str) or not 0 < len(kid) <= 128:
            raise ValidationError("signed frame.kid", "a string of 1..128 characters", kid)
        key = self._lookup(kid)
        if key is None:
            raise SignatureError(f"unknown key id {kid!r}")
        if not key.verify(inner, sig):
            raise SignatureError(
                f"bad {key.algorithm} signature for key {kid!r} (tampered or wrong key)"
            )
        inner_map = decode_frame_map(inner, limits)
        if "sm" in inner_map:
            raise DecodeError("signed frame: the signed message is itself a signed frame")
        env = envelope_from_map(inner_map)
        if env.sender != kid:
            raise SignatureError(f"key {kid!r} cannot sign for sender {env.sender!r}")
        self._check_fresh(env)
        return env

    def _check_fresh(self, env: Envelope) -> None:
        now = self.clock()
        if abs(now - env.ts) > self.window:
            raise SignatureError(
                f"{env.kind} {env.msg_id} from {env.sender}: timestamp is {now - env.ts:+.0f} s "
                f"from now, outside the +-{self.window:g} s window"
            )
        key = (env.sender, env.msg_id)
        with self._lock:
            while self._seen:
                oldest_key, first_seen = next(iter(self._seen.items()))
                if first_seen >= now - 2 * self.window and len(self._seen) < self.max_entries:
                    break
                del self._seen[oldest_key]
            if key in self._seen:
                raise SignatureError(f"replayed {env.kind} {env.msg_id} from {env.sender}")
            self._seen[key] = now
