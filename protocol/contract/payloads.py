"""Reusable knowledge payloads carried by tasks and replies (see ``WIRE.md`` §Payloads).

Each payload is a frozen dataclass that normalises its arrays to their wire dtypes and checks
shapes, finiteness and class ids in ``__post_init__``, so an instance, whether built locally
or decoded from a peer, is always consistent. ``encoding`` selects the lossy transport of its
float arrays (``raw``, ``f16``, ``i8``, ``u8``); receivers always see float32.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

import msgpack
import numpy as np
import numpy.typing as npt

from protocol.contract.arrays import ENCODINGS, Encoding
from protocol.contract.validate import as_array, check_class_ids, check_finite, check_shape
from protocol.contract.wire import WireModel, tagged_wire
from protocol.errors import ValidationError

__all__ = [
    "PAYLOAD_TYPES",
    "ClassStats",
    "FeatureLogitSet",
    "ImageVectorPairs",
    "LabelledVectors",
    "Payload",
    "PrototypeSet",
    "TensorMap",
    "pack_payloads",
    "unpack_payloads",
]

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]


def _set(obj: object, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # frozen dataclass: normalise once, in __post_init__


def _check_encoding(encoding: str, allowed: tuple[str, ...] = ENCODINGS) -> None:
    if encoding not in allowed:
        raise ValidationError("encoding", f"one of {allowed}", encoding)


@dataclass(frozen=True, slots=True)
class PrototypeSet(WireModel):
    """Per-class mean vectors with explicit class ids, counts and an optional SD vector.

    ``vectors[i]`` is the prototype of class ``class_ids[i]``; ``sd`` (FedVTC's sigma) is one
    vector for the whole sender, not per class. ``valid`` optionally flags ids whose vector
    is meaningful (FedVTC's ``proto_valid``); absent means all valid.
    """

    KIND: ClassVar[str] = "protos"
    ENCODING_FIELD: ClassVar[str | None] = "encoding"

    class_ids: I32
    vectors: F32
    counts: I32
    sd: F32 | None = None
    encoding: Encoding = "raw"

    def __post_init__(self) -> None:
        _check_encoding(self.encoding, ("raw", "f16"))
        _set(self, "class_ids", as_array(self.class_ids, "<i4", "class_ids"))
        _set(self, "vectors", as_array(self.vectors, "<f4", "vectors"))
        _set(self, "counts", as_array(self.counts, "<i4", "counts"))
        m = self.class_ids.shape[0] if self.class_ids.ndim == 1 else -1
        check_shape(self.class_ids, (None,), "class_ids")
        check_shape(self.vectors, (m, None), "vectors")
        check_shape(self.counts, (m,), "counts")
        check_class_ids(self.class_ids, "class_ids")
        check_finite(self.vectors, "vectors")
        if self.counts.size and int(self.counts.min()) < 0:
            raise ValidationError("counts", "non-negative counts", int(self.counts.min()))
        if self.sd is not None:
            _set(self, "sd", as_array(self.sd, "<f4", "sd"))
            check_shape(self.sd, (self.dim,), "sd")
            check_finite(self.sd, "sd")
            if self.sd.size and float(self.sd.min()) <= 0:
                raise ValidationError("sd", "positive standard deviations", float(self.sd.min()))

    @property
    def dim(self) -> int:
        """Length of each prototype vector."""
        return int(self.vectors.shape[1])

    def as_dict(self) -> dict[int, F32]:
        """``{class_id: vector}``."""
        return {int(c): self.vectors[i] for i, c in enumerate(self.class_ids)}


@dataclass(frozen=True, slots=True)
class FeatureLogitSet(WireModel):
    """Class-wise mean features and mean logits (Felo/Velo), with the counts behind each mean."""

    KIND: ClassVar[str] = "featlogits"
    ENCODING_FIELD: ClassVar[str | None] = "encoding"

    class_ids: I32
    features: F32
    logits: F32
    counts: I32
    encoding: Encoding = "raw"

    def __post_init__(self) -> None:
        _check_encoding(self.encoding, ("raw", "f16"))
        _set(self, "class_ids", as_array(self.class_ids, "<i4", "class_ids"))
        _set(self, "features", as_array(self.features, "<f4", "features"))
        _set(self, "logits", as_array(self.logits, "<f4", "logits"))
        _set(self, "counts", as_array(self.counts, "<i4", "counts"))
        check_shape(self.class_ids, (None,), "class_ids")
        m = self.class_ids.shape[0]
        check_shape(self.features, (m, None), "features")
        check_shape(self.logits, (m, None), "logits")
        check_shape(self.counts, (m,), "counts")
        check_class_ids(self.class_ids, "class_ids", self.logits.shape[1] if m else None)
        check_finite(self.features, "features")
        check_finite(self.logits, "logits")


@dataclass(frozen=True, slots=True)
class ClassStats(WireModel):
    """Per-class feature means, covariances and counts (CCVR's classifier calibration).

    ``covariances[i]`` is the ``d x d`` covariance of class ``class_ids[i]``: symmetric, with a
    non-negative diagonal (positive semi-definiteness is the sender's promise; checking it would
    cost an eigendecomposition per class, and the receiver regularises before sampling anyway).
    """

    KIND: ClassVar[str] = "classstats"
    ENCODING_FIELD: ClassVar[str | None] = "encoding"

    class_ids: I32
    means: F32
    covariances: F32
    counts: I32
    encoding: Encoding = "raw"

    def __post_init__(self) -> None:
        _check_encoding(self.encoding, ("raw", "f16"))
        _set(self, "class_ids", as_array(self.class_ids, "<i4", "class_ids"))
        _set(self, "means", as_array(self.means, "<f4", "means"))
        _set(self, "covariances", as_array(self.covariances, "<f4", "covariances"))
        _set(self, "counts", as_array(self.counts, "<i4", "counts"))
        check_shape(self.class_ids, (None,), "class_ids")
        m = self.class_ids.shape[0]
        check_shape(self.means, (m, None), "means")
        d = self.means.shape[1]
        check_shape(self.covariances, (m, d, d), "covariances")
        check_shape(self.counts, (m,), "counts")
        check_class_ids(self.class_ids, "class_ids")
        check_finite(self.means, "means")
        check_finite(self.covariances, "covariances")
        if self.counts.size and int(self.counts.min()) < 1:
            raise ValidationError("counts", "at least one sample per class", int(self.counts.min()))
        cov = self.covariances
        if not np.array_equal(cov, cov.transpose(0, 2, 1)):
            raise ValidationError("covariances", "symmetric matrices", "an asymmetric matrix")
        diag = np.diagonal(cov, axis1=1, axis2=2)
        if diag.size and float(diag.min()) < 0:
            raise ValidationError("covariances", "non-negative variances", float(diag.min()))


@dataclass(frozen=True, slots=True)
class ImageVectorPairs(WireModel):
    """Generator-made images (uint8, N x C x H x W) with their latent vectors (FedKTL).

    ``class_ids[i]`` (optional) is the class image ``i`` and latent ``i`` belong to; the payload
    checks they are unique and non-negative, the receiver that knows the class count checks
    the upper bound. ``round`` is the round whose server phase made the pairs: it can lag the
    task's round by more than one (a round without uploads keeps the previous pairs).
    """

    KIND: ClassVar[str] = "ivpairs"
    ENCODING_FIELD: ClassVar[str | None] = "encoding"

    images: npt.NDArray[np.uint8]
    vectors: F32
    class_ids: I32 | None = None
    round: int = 0
    encoding: Encoding = "raw"

    def __post_init__(self) -> None:
        _check_encoding(self.encoding, ("raw", "f16"))
        _set(self, "images", as_array(self.images, "|u1", "images"))
        _set(self, "vectors", as_array(self.vectors, "<f4", "vectors"))
        n = self.images.shape[0] if self.images.ndim == 4 else -1
        check_shape(self.images, (None, None, None, None), "images")
        check_shape(self.vectors, (n, None), "vectors")
        check_finite(self.vectors, "vectors")
        if self.class_ids is not None:
            _set(self, "class_ids", as_array(self.class_ids, "<i4", "class_ids"))
            check_shape(self.class_ids, (n,), "class_ids")
            check_class_ids(self.class_ids, "class_ids")
        if type(self.round) is not int or self.round < 0:  # bool is an int: refuse it too
            raise ValidationError("round", "a non-negative int", self.round)


@dataclass(frozen=True, slots=True)
class LabelledVectors(WireModel):
    """Individual vectors, each with its class: a sample of a device's per-sample features
    (Velo's ``upload_samples``), so that the server learns their distribution, not a mean.

    Labels repeat (several vectors per class); the receiver that knows the class count checks
    the upper bound and how many a class may have.
    """

    KIND: ClassVar[str] = "labelled"
    ENCODING_FIELD: ClassVar[str | None] = "encoding"

    labels: I32
    vectors: F32
    encoding: Encoding = "raw"

    def __post_init__(self) -> None:
        _check_encoding(self.encoding, ("raw", "f16"))
        _set(self, "labels", as_array(self.labels, "<i4", "labels"))
        _set(self, "vectors", as_array(self.vectors, "<f4", "vectors"))
        check_shape(self.labels, (None,), "labels")
        check_shape(self.vectors, (self.labels.shape[0], None), "vectors")
        check_finite(self.vectors, "vectors")
        if self.labels.size and int(self.labels.min()) < 0:
            raise ValidationError("labels", "non-negative class ids", int(self.labels.min()))


@dataclass(frozen=True, slots=True)
class TensorMap(WireModel):
    """Named tensors: model, generator or proxy weights (a state dict without pickle).

    Float tensors follow ``encoding`` (``i8`` = per-tensor affine int8); integer tensors such as
    BatchNorm's ``num_batches_tracked`` always travel exactly.
    """

    KIND: ClassVar[str] = "tensors"
    ENCODING_FIELD: ClassVar[str | None] = "encoding"

    tensors: dict[str, npt.NDArray[Any]] = field(default_factory=dict)
    encoding: Encoding = "raw"

    def __post_init__(self) -> None:
        _check_encoding(self.encoding, ("raw", "f16", "i8"))
        normalised: dict[str, npt.NDArray[Any]] = {}
        for name, value in self.tensors.items():
            if not isinstance(name, str) or not name:
                raise ValidationError("tensors", "non-empty string names", name)
            arr = np.asarray(value)
            dtype = "<f4" if arr.dtype.kind == "f" else "<i8" if arr.dtype.kind in "iu" else "|b1"
            arr = as_array(arr, dtype, f"tensors.{name}")
            check_finite(arr, f"tensors.{name}")
            normalised[name] = arr
        _set(self, "tensors", normalised)

    @property
    def num_bytes(self) -> int:
        """Raw size of all tensors (before any lossy encoding)."""
        return sum(int(a.nbytes) for a in self.tensors.values())


Payload = Union[  # noqa: UP007
    PrototypeSet, FeatureLogitSet, ClassStats, ImageVectorPairs, LabelledVectors, TensorMap
]
PAYLOAD_TYPES: dict[str, type[WireModel]] = {
    t.KIND: t
    for t in (
        PrototypeSet,
        FeatureLogitSet,
        ClassStats,
        ImageVectorPairs,
        LabelledVectors,
        TensorMap,
    )
}


def pack_payloads(payloads: Mapping[str, Payload]) -> bytes:
    """Named payloads as bytes with the wire converter (no pickle): the msgpack map of tagged
    payloads (§6) with its names sorted, so equal maps give equal bytes (the knowledge digest,
    ``WIRE.md`` §5, hashes exactly these bytes; the coordinator's store keeps its state so)."""
    obj = {name: tagged_wire(payloads[name]) for name in sorted(payloads)}
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def unpack_payloads(blob: bytes) -> dict[str, Payload]:
    """Inverse of :func:`pack_payloads` for trusted bytes (the store's own)."""
    obj = msgpack.unpackb(blob, raw=False)
    out: dict[str, Payload] = {}
    for k, v in obj.items():
        cls = PAYLOAD_TYPES[v.pop("t")]
        out[k] = cls.from_wire(v, k)  # type: ignore[assignment]
    return out
