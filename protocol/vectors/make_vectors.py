"""Generate the wire test vectors: ``NAME.msgpack`` (exact bytes) and ``NAME.json`` (meaning).

Run from the repository root::

    python -m protocol.vectors.make_vectors            # rewrite every vector
    python -m protocol.vectors.make_vectors --check    # verify the stored ones, change nothing

Each JSON file holds the decoded message in wire layout (``WIRE.md`` §Test vectors): the
frame fields, then the body map with its field names and ``"t"`` tags; each array appears as
``{"dtype", "shape", "data"}`` with the *decoded* values (float32 after a lossy encoding,
little-endian C-order bytes in base64) and each byte string as ``{"base64": ...}``. The
payload's ``encoding`` field says how its float arrays travel. :func:`envelope_from_json`
rebuilds the message; encoding it must reproduce the ``.msgpack`` byte for byte.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from protocol.contract.arrays import Encoding, decode_array, encode_array
from protocol.contract.chunking import split_frame
from protocol.contract.codec import SCHEMA_VERSION, Envelope, encode, envelope_from_map
from protocol.contract.messages import (
    Ack,
    Capabilities,
    ChunkRequest,
    CoordinatorState,
    ErrorReply,
    Fetch,
    InputSpec,
    Knowledge,
    Message,
    Progress,
    Register,
    Reply,
    RoundDescriptor,
    Status,
    Task,
    payloads_digest,
)
from protocol.contract.payloads import (
    ClassStats,
    FeatureLogitSet,
    ImageVectorPairs,
    LabelledVectors,
    PrototypeSet,
    TensorMap,
)
from protocol.security.signing import HmacSigner

__all__ = ["VECTOR_DIR", "array_from_json", "envelope_from_json", "envelope_to_json"]

VECTOR_DIR = Path(__file__).resolve().parent
TS = 1767225600.0  # 2026-01-01T00:00:00Z
HMAC_KEY = bytes(range(32))  # published test key: never use it for anything real
ED25519_SEED = bytes(range(32, 64))
_ARRAY_KEYS = {"dtype", "shape", "data"}
CIFAR10 = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


# -- JSON <-> wire values -------------------------------------------------------------------


def _array_json(arr: npt.NDArray[Any]) -> dict[str, Any]:
    a = arr.astype(arr.dtype.newbyteorder("<"), copy=False)  # keeps 0-d arrays 0-d
    return {
        "dtype": a.dtype.str,
        "shape": list(a.shape),
        "data": base64.b64encode(a.tobytes(order="C")).decode(),
    }


def array_from_json(obj: dict[str, Any]) -> npt.NDArray[Any]:
    """The numpy array described by a ``{"dtype", "shape", "data"}`` JSON node."""
    raw = base64.b64decode(obj["data"])
    flat: npt.NDArray[Any] = np.frombuffer(raw, dtype=np.dtype(obj["dtype"])).copy()
    shaped: npt.NDArray[Any] = flat.reshape(tuple(obj["shape"]))
    return shaped


def _wire_to_json(value: Any) -> Any:
    if isinstance(value, dict):
        if {"dt", "sh", "d"} <= set(value):  # an array map: show the decoded values
            return _array_json(decode_array(value))
        return {k: _wire_to_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_wire_to_json(v) for v in value]
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode()}
    return value


def _json_to_wire(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == _ARRAY_KEYS:  # decoded values travel exactly; the model re-encodes
            arr = array_from_json(value)
            return {"dt": arr.dtype.str, "sh": list(arr.shape), "d": arr.tobytes()}
        if set(value) == {"base64"} and isinstance(value["base64"], str):
            return base64.b64decode(value["base64"])
        return {k: _json_to_wire(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_to_wire(v) for v in value]
    return value


def envelope_to_json(env: Envelope) -> dict[str, Any]:
    """The JSON description of an envelope (frame fields and decoded body)."""
    return {
        "v": SCHEMA_VERSION,
        "k": env.kind,
        "f": env.federation,
        "s": env.sender,
        "i": env.msg_id,
        "r": env.round,
        "t": env.ts,
        "b": _wire_to_json(env.body.to_wire()),
    }


def envelope_from_json(obj: dict[str, Any]) -> Envelope:
    """Rebuild the envelope a vector's JSON describes (validated like any decoded frame)."""
    frame = {k: obj[k] for k in ("v", "k", "f", "s", "i", "r", "t")}
    return envelope_from_map(frame | {"b": _json_to_wire(obj["b"])})


# -- the vectors ------------------------------------------------------------------------------


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _protos(encoding: Encoding) -> PrototypeSet:
    r = _rng(1)
    return PrototypeSet(
        class_ids=np.array([0, 3, 7], np.int32),
        vectors=r.standard_normal((3, 4)).astype(np.float32),
        counts=np.array([12, 5, 9], np.int32),
        sd=(r.random(4) + 0.5).astype(np.float32),
        encoding=encoding,
    )


def _featlogits(encoding: Encoding) -> FeatureLogitSet:
    r = _rng(2)
    return FeatureLogitSet(
        class_ids=np.array([1, 2], np.int32),
        features=r.standard_normal((2, 3)).astype(np.float32),
        logits=r.standard_normal((2, 4)).astype(np.float32),
        counts=np.array([4, 6], np.int32),
        encoding=encoding,
    )


def _classstats(encoding: Encoding) -> ClassStats:
    r = _rng(5)
    a = r.standard_normal((2, 3, 3))
    cov = a @ a.transpose(0, 2, 1)  # positive semi-definite; averaged with its transpose below
    return ClassStats(
        class_ids=np.array([0, 3], np.int32),
        means=r.standard_normal((2, 3)).astype(np.float32),
        covariances=((cov + cov.transpose(0, 2, 1)) / 2).astype(np.float32),
        counts=np.array([5, 7], np.int32),
        encoding=encoding,
    )


def _ivpairs(encoding: Encoding) -> ImageVectorPairs:
    r = _rng(3)
    return ImageVectorPairs(
        images=r.integers(0, 256, (2, 1, 2, 3), dtype=np.uint8),
        vectors=r.standard_normal((2, 3)).astype(np.float32),
        class_ids=np.array([4, 1], np.int32),
        round=2,
        encoding=encoding,
    )


def _labelled(encoding: Encoding) -> LabelledVectors:
    r = _rng(6)
    return LabelledVectors(
        labels=np.array([2, 0, 2], np.int32),
        vectors=r.standard_normal((3, 4)).astype(np.float32),
        encoding=encoding,
    )


def _tensors(encoding: Encoding) -> TensorMap:
    r = _rng(4)
    return TensorMap(
        {
            "conv.weight": r.standard_normal((2, 1, 2, 2)).astype(np.float32),
            "bn.num_batches_tracked": np.array(7, np.int64),
            "mask": np.array([True, False, True]),
        },
        encoding=encoding,
    )


def _task(name: str, payload: Any) -> Task:
    return Task(
        task_id="task-0001",
        run_id="run-a",
        round=3,
        phase="train",
        deadline=TS + 600.0,
        algorithm="fedproto",
        config={"epochs": 2, "lr": 0.05, "momentum_on": True, "loss": "ce"},
        payloads={name: payload},
    )


def _reply(name: str, payload: Any) -> Reply:
    return Reply(
        task_id="task-0001",
        round=3,
        phase="train",
        num_samples=240,
        payloads={name: payload},
        metrics={"loss": 0.4375, "acc": 0.875},
    )


def _messages() -> dict[str, tuple[Message, str]]:
    register = Register(
        device_id="jetson-01",
        arch="resnet8",
        num_params=77_850,
        capabilities=Capabilities(
            device="cuda", accelerator="Orin Nano", memory_mb=8192, cpu_count=6
        ),
        input_spec=InputSpec(channels=3, height=32, width=32),
        num_classes=10,
        class_counts={"0": 120, "3": 40},
        algorithm="fedproto",
        agent_version="0.1.0",
        class_names=list(CIFAR10),
        session="5eed5eed5eed5eed",
    )
    return {
        "register": (register, "agent registration"),
        "register_classes": (
            dataclasses.replace(register, class_counts={}, classes=[0, 3], num_samples=160),
            "agent registration with its class set and size, not its label histogram",
        ),
        "status_online": (Status(state="online"), "agent birth message (retained)"),
        "coord_state": (
            CoordinatorState(
                state="running",
                run_id="run-a",
                algorithm="fedproto",
                round=3,
                total_rounds=50,
                classes=list(CIFAR10),
            ),
            "coordinator state",
        ),
        "coord_state_class_set": (
            CoordinatorState(
                state="starting",
                run_id="run-b",
                algorithm="fedavg",
                round=0,
                total_rounds=50,
                class_counts=False,
            ),
            "coordinator state of a run whose agents register only their class set",
        ),
        "round": (
            RoundDescriptor(
                run_id="run-a",
                round=3,
                phase="train",
                deadline=TS + 600.0,
                selected=["jetson-01", "pi-02"],
            ),
            "round descriptor",
        ),
        "task_tensors_raw": (_task("model", _tensors("raw")), "task with exact weights"),
        "task_tensors_f16": (_task("model", _tensors("f16")), "task, weights as float16"),
        "reply_tensors_i8": (_reply("model", _tensors("i8")), "reply, weights as int8"),
        "task_protos_raw": (_task("global_protos", _protos("raw")), "global prototypes"),
        "reply_protos_f16": (_reply("protos", _protos("f16")), "prototypes as float16"),
        "reply_featlogits_raw": (_reply("featlogits", _featlogits("raw")), "Felo features"),
        "reply_featlogits_f16": (_reply("featlogits", _featlogits("f16")), "as float16"),
        "reply_classstats_raw": (_reply("stats", _classstats("raw")), "CCVR class statistics"),
        "reply_labelled_f16": (_reply("samples", _labelled("f16")), "Velo per-sample features"),
        "task_ivpairs_raw": (_task("pairs", _ivpairs("raw")), "FedKTL image-vector pairs"),
        "task_ivpairs_f16": (_task("pairs", _ivpairs("f16")), "pairs, vectors as float16"),
        "error": (
            ErrorReply(
                code="OutOfMemory",
                reason="batch too large",
                task_id="task-0001",
                ref_id="00112233445566ff",
            ),
            "error reply",
        ),
        "ack": (Ack(ref_id="00112233445566ff", task_id="task-0001"), "coordinator ack"),
        "progress": (
            Progress(
                task_id="task-0001",
                round=3,
                phase="train",
                step=40,
                total=100,
                loss=0.5,
                samples_per_s=812.5,
            ),
            "progress heartbeat (QoS 0)",
        ),
        "chunk_req": (
            ChunkRequest(digest=hashlib.sha256(b"edgefl").digest(), missing=[1, 4]),
            "request for missing chunks",
        ),
        "knowledge": (
            Knowledge.of(3, {"global_protos": _protos("raw")}),
            "a step's shared knowledge (bcast/knowledge, retained)",
        ),
        "task_shared": (
            dataclasses.replace(
                _task("global_protos", _protos("raw")),
                payloads={},
                shared=payloads_digest({"global_protos": _protos("raw")}),
            ),
            "task whose payloads are the knowledge it names",
        ),
        "fetch": (
            Fetch(digest=payloads_digest({"global_protos": _protos("raw")})),
            "a device asks for the knowledge its task names",
        ),
    }


def _env(body: Message, sender: str = "jetson-01") -> Envelope:
    return Envelope(
        body=body, sender=sender, federation="demo", round=3, msg_id="00112233445566ff", ts=TS
    )


def build() -> dict[str, tuple[bytes, dict[str, Any]]]:
    """Every vector: name -> (exact bytes, JSON description)."""
    out: dict[str, tuple[bytes, dict[str, Any]]] = {}
    for name, (body, text) in _messages().items():
        env = _env(body)
        out[name] = encode(env), {"description": text, "frame": envelope_to_json(env)}
    big = encode(_env(_reply("model", _tensors("raw"))))
    chunk = split_frame(big, 256)[1]
    env = _env(chunk)
    out["chunk"] = (
        encode(env),
        {
            "description": "chunk 1 of a reply frame cut into 256-byte pieces",
            "frame": envelope_to_json(env),
        },
    )
    ack = _env(Ack(ref_id="00112233445566ff"), sender="coordinator")
    signer = HmacSigner("coordinator", HMAC_KEY)
    out["signed_hmac_ack"] = (
        signer.sign(encode(ack)),
        {
            "description": "ack signed with HMAC-SHA256; key id = sender",
            "signature": {
                "algorithm": "hmac-sha256",
                "kid": "coordinator",
                "key": {"base64": base64.b64encode(HMAC_KEY).decode()},
            },
            "frame": envelope_to_json(ack),
        },
    )
    ed = _ed25519_vector(ack)
    if ed is not None:
        out["signed_ed25519_ack"] = ed
    for encoding, values in (
        ("u8", _rng(5).random((2, 3))),
        ("i8", _rng(6).standard_normal(6)),
        ("f16", _rng(7).standard_normal((3,))),
        ("raw", np.arange(4.0)),
    ):
        wire = encode_array(np.asarray(values, np.float32), encoding)  # type: ignore[arg-type]
        out[f"array_{encoding}"] = (
            msgpack.packb(wire, use_bin_type=True),
            {
                "description": f"a bare array map, {encoding} encoding of float32 values",
                "encoding": encoding,
                "array": _array_json(decode_array(wire)),
            },
        )
    return out


def _ed25519_vector(ack: Envelope) -> tuple[bytes, dict[str, Any]] | None:
    try:
        from protocol.security.signing import Ed25519Signer

        signer = Ed25519Signer("coordinator", ED25519_SEED)
    except Exception:  # cryptography not installed: keep the stored vector as it is
        return None
    public = signer.public_key_bytes()
    return signer.sign(encode(ack)), {
        "description": "ack signed with Ed25519 (RFC 8032, deterministic)",
        "signature": {
            "algorithm": "ed25519",
            "kid": "coordinator",
            "private_seed": {"base64": base64.b64encode(ED25519_SEED).decode()},
            "public_key": {"base64": base64.b64encode(public).decode()},
        },
        "frame": envelope_to_json(ack),
    }


def rebuild(description: dict[str, Any]) -> bytes:
    """The bytes a vector's JSON description encodes to (what an implementation must emit)."""
    if "array" in description:
        arr = array_from_json(description["array"])
        return msgpack.packb(encode_array(arr, description["encoding"]), use_bin_type=True)  # type: ignore[no-any-return]
    frame = encode(envelope_from_json(description["frame"]))
    sig = description.get("signature")
    if sig is None:
        return frame
    key = base64.b64decode((sig.get("key") or sig["private_seed"])["base64"])
    make: Callable[[str, bytes], Any] = HmacSigner
    if sig["algorithm"] == "ed25519":
        from protocol.security.signing import Ed25519Signer

        make = Ed25519Signer
    return make(sig["kid"], key).sign(frame)  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` verify) every vector in ``VECTOR_DIR``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="verify, do not write")
    args = parser.parse_args(argv)
    bad = 0
    for name, (data, description) in build().items():
        bin_path, json_path = VECTOR_DIR / f"{name}.msgpack", VECTOR_DIR / f"{name}.json"
        text = json.dumps(description, indent=1) + "\n"
        if args.check:
            if bin_path.read_bytes() != data or json_path.read_text() != text:
                print(f"{name}: stored vector differs from the generated one", file=sys.stderr)
                bad += 1
            continue
        bin_path.write_bytes(data)
        json_path.write_text(text)
    print(f"{'checked' if args.check else 'wrote'} vectors in {VECTOR_DIR}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
