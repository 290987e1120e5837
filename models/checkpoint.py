"""Agent checkpoints: one ``torch.save`` file of plain types and tensors.

The edge agent writes a checkpoint and ``edge-export`` reads it, possibly on another machine and
with another toolkit version, so the file holds only what ``torch.load(..., weights_only=True)``
accepts (dicts, lists, str, int, float, bool, None, tensors) and never a pickled module:
loading a checkpoint can therefore never execute code. Layout (``FORMAT``)::

    {"format": "edgefl.checkpoint/1",
     "model": {"name", "num_classes", "in_chans", "feature_dim", "input_size": [h, w],
               optional "mean", "std", "feature_act", "model_args"},
     "state_dict": {name: tensor},
     "head": {"type": "logits" | "prototype" | "cosine", "prototypes": [C, D], "valid": bool [C]},
     "meta": {"algorithm", "round", "federation", "run_id", "device_id", "class_names",
              "toolkit_version", "metrics"},
     "extra": {name: tensor}}

The optional ``model`` keys carry the rest of ``Classifier.create_kwargs``: the normalisation
statistics live in non-persistent buffers (not in the state dict), so without them a rebuilt
model would silently normalise differently.
"""

from __future__ import annotations

import copy
import hashlib
import os
import re
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from torch import Tensor

from models.checkpoint_checks import (
    STR_MAP,
    CheckpointError,
    as_tensor,
    as_type,
    check_meta,
    check_state_dict,
    describe,
    first_line,
    int_at_least,
    required,
    tensor_map,
)
from protocol.errors import EdgeFLError

if TYPE_CHECKING:
    from models._classifier import Classifier

__all__ = [
    "FORMAT",
    "Checkpoint",
    "CheckpointError",
    "HeadSpec",
    "HeadType",
    "ModelSpec",
    "build_model",
    "file_sha256",
    "load_checkpoint",
    "save_checkpoint",
    "toolkit_version",
]

FORMAT = "edgefl.checkpoint/1"
HeadType = Literal["logits", "prototype", "cosine"]
HEAD_TYPES: tuple[str, ...] = get_args(HeadType)

_PLAIN = (str, int, float, bool, type(None))


def toolkit_version() -> str:
    """Installed edgefl version, or ``"0+unknown"`` when running from an uninstalled tree."""
    try:
        return importlib_metadata.version("edgefl")
    except importlib_metadata.PackageNotFoundError:
        return "0+unknown"


@dataclass(frozen=True)
class ModelSpec:
    """The architecture a state dict belongs to: the arguments of ``models.create_model``.

    Attributes:
        name: Registry name.
        num_classes: Classes of the head.
        in_chans: Input channels.
        feature_dim: Projected feature size, or None for the trunk's native size.
        input_size: ``(h, w)`` the model was built for.
        mean: Normalisation mean applied inside the model, or None.
        std: Normalisation std applied inside the model, or None.
        feature_act: Activation after the projection, or None.
        model_args: Architecture-specific keyword arguments (plain values).
    """

    name: str
    num_classes: int
    in_chans: int
    feature_dim: int | None
    input_size: tuple[int, int]
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    feature_act: str | None = None
    model_args: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_model(cls, model: Classifier) -> ModelSpec:
        """The spec that rebuilds ``model`` (which must come from ``create_model``)."""
        if model.model_name is None:
            raise CheckpointError(
                "model has no registry name (model_name is None): only models built with "
                "models.create_model can be checkpointed and rebuilt"
            )
        kw = dict(model.create_kwargs)
        known = (
            "num_classes",
            "in_chans",
            "feature_dim",
            "input_size",
            "mean",
            "std",
            "feature_act",
        )
        spec = {"name": model.model_name, **{k: kw.pop(k, None) for k in known}}
        for key in ("input_size", "mean", "std"):  # from_dict reads the stored form: lists
            if isinstance(spec[key], tuple):
                spec[key] = list(spec[key])
        return cls.from_dict({**spec, "model_args": kw}, where="model")

    def create_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``create_model(self.name, **kwargs)``."""
        return {
            "num_classes": self.num_classes,
            "in_chans": self.in_chans,
            "feature_dim": self.feature_dim,
            "input_size": self.input_size,
            "mean": self.mean,
            "std": self.std,
            "feature_act": self.feature_act,
            **self.model_args,
        }

    def to_dict(self) -> dict[str, Any]:
        """Plain-type form stored under ``"model"``."""
        return {
            "name": self.name,
            "num_classes": self.num_classes,
            "in_chans": self.in_chans,
            "feature_dim": self.feature_dim,
            "input_size": list(self.input_size),
            "mean": None if self.mean is None else list(self.mean),
            "std": None if self.std is None else list(self.std),
            "feature_act": self.feature_act,
            "model_args": dict(self.model_args),
        }

    @classmethod
    def from_dict(cls, obj: object, where: str) -> ModelSpec:
        """Parse and validate the ``"model"`` entry (``where`` prefixes error messages)."""
        d = as_type(STR_MAP, obj, where)
        size = required(d, "input_size", tuple[int, ...], where, "[h, w] positive ints")
        if len(size) != 2 or min(size) < 1:
            raise CheckpointError(
                f"{where}.input_size: expected [h, w] positive ints, got {d['input_size']!r}"
            )
        feature_dim = required(d, "feature_dim", int | None, where, "an int >= 1 or None")
        if feature_dim is not None and feature_dim < 1:
            raise CheckpointError(
                f"{where}.feature_dim: expected an int >= 1 or None, got {feature_dim!r}"
            )
        model_args = as_type(STR_MAP, d.get("model_args", {}), f"{where}.model_args")
        for key, value in model_args.items():
            if not isinstance(value, (*_PLAIN, list, tuple)):
                raise CheckpointError(
                    f"{where}.model_args.{key}: expected a plain value, got {type(value).__name__}"
                )
        name = required(d, "name", str, where)
        if not name:
            raise CheckpointError(f"{where}.name: expected a non-empty str")
        return cls(
            name=name,
            num_classes=int_at_least(d, "num_classes", 0, where),
            in_chans=int_at_least(d, "in_chans", 1, where),
            feature_dim=feature_dim,
            input_size=size,
            mean=as_type(tuple[float, ...] | None, d.get("mean"), f"{where}.mean"),
            std=as_type(tuple[float, ...] | None, d.get("std"), f"{where}.std"),
            feature_act=as_type(str | None, d.get("feature_act"), f"{where}.feature_act"),
            model_args=model_args,
        )


@dataclass(frozen=True, eq=False)  # eq=False: tensor fields have no boolean equality
class HeadSpec:
    """The inference head an exported model carries.

    Attributes:
        type: ``"logits"`` (the model's own classifier), ``"prototype"`` (nearest prototype by
            squared L2 distance) or ``"cosine"`` (normalised features · normalised fixed
            vectors, FedKTL's ETF head).
        prototypes: ``[C, D]`` float tensor for ``prototype``/``cosine``, else None.
        valid: ``[C]`` bool tensor; classes marked False never win. None means all valid.
    """

    type: HeadType
    prototypes: Tensor | None = None
    valid: Tensor | None = None

    def __post_init__(self) -> None:
        if self.type not in HEAD_TYPES:
            raise CheckpointError(
                f"head.type: expected one of {list(HEAD_TYPES)}, got {self.type!r}"
            )
        if self.type == "logits":
            if self.prototypes is not None or self.valid is not None:
                raise CheckpointError("head: a 'logits' head takes no prototypes or valid mask")
            return
        protos = self.prototypes
        if not isinstance(protos, Tensor) or protos.dim() != 2 or not protos.is_floating_point():
            raise CheckpointError(
                f"head.prototypes: a {self.type!r} head needs a float tensor [C, D], "
                f"got {describe(protos)}"
            )
        if not bool(torch.isfinite(protos).all()):
            raise CheckpointError("head.prototypes: contains NaN or infinite values")
        num = protos.shape[0]
        valid = self.valid
        if valid is not None and (
            not isinstance(valid, Tensor)
            or valid.dtype != torch.bool
            or tuple(valid.shape) != (num,)
        ):
            raise CheckpointError(
                f"head.valid: expected a bool tensor [{num}], got {describe(valid)}"
            )
        if valid is not None and not bool(valid.any()):
            raise CheckpointError("head.valid: no class is valid, the head could never predict")
        # Stored detached, on the CPU and in float32 so that export bakes exact constants.
        object.__setattr__(self, "prototypes", protos.detach().to("cpu", torch.float32))
        if valid is not None:
            object.__setattr__(self, "valid", valid.detach().cpu())

    @property
    def num_classes(self) -> int | None:
        """Rows of the prototype table, or None for a logits head."""
        return None if self.prototypes is None else int(self.prototypes.shape[0])

    def valid_mask(self) -> Tensor | None:
        """The ``[C]`` validity mask with None expanded to all-True (None for logits)."""
        if self.prototypes is None:
            return None
        if self.valid is None:
            return torch.ones(self.prototypes.shape[0], dtype=torch.bool)
        return self.valid

    def to_dict(self) -> dict[str, Any]:
        """Plain-type form stored under ``"head"``."""
        if self.type == "logits":
            return {"type": "logits"}
        return {"type": self.type, "prototypes": self.prototypes, "valid": self.valid_mask()}

    @classmethod
    def from_dict(cls, obj: object, where: str) -> HeadSpec:
        """Parse and validate the ``"head"`` entry."""
        d = as_type(STR_MAP, obj, where)
        kind = required(d, "type", str, where)
        if kind == "logits":
            return cls(type="logits")
        if kind in HEAD_TYPES:
            for key in ("prototypes", "valid"):
                as_tensor(required(d, key, object, where), f"{where}.{key}")
        try:
            return cls(type=kind, prototypes=d.get("prototypes"), valid=d.get("valid"))
        except CheckpointError as exc:
            raise CheckpointError(f"{where}: {exc}") from None


@dataclass
class Checkpoint:
    """Everything an agent persists about its model.

    Attributes:
        model_spec: The architecture.
        state_dict: Its weights (``strict`` match against ``model_spec`` is required).
        head: The inference head the algorithm predicts with.
        meta: Run information (algorithm, round, federation, class names, metrics, ...).
        extra: Algorithm state tensors (e.g. a generator's weights).
    """

    model_spec: ModelSpec
    state_dict: dict[str, Tensor]
    head: HeadSpec
    meta: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        tensor_map(self.state_dict, "state_dict")
        tensor_map(self.extra, "extra")
        check_meta(self.meta, "meta")
        rows = self.head.num_classes
        if rows is not None and rows != self.model_spec.num_classes:
            raise CheckpointError(
                f"head.prototypes: {rows} rows but model.num_classes is "
                f"{self.model_spec.num_classes}"
            )

    @classmethod
    def from_model(
        cls,
        model: Classifier,
        head: HeadSpec,
        meta: Mapping[str, Any] | None = None,
        extra: Mapping[str, Tensor] | None = None,
    ) -> Checkpoint:
        """Snapshot ``model`` (weights copied to the CPU) with its head and run information."""
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        base: dict[str, Any] = {"toolkit_version": toolkit_version()}
        return cls(
            ModelSpec.from_model(model),
            state,
            head,
            copy.deepcopy({**base, **(meta or {})}),
            dict(extra or {}),
        )

    def to_dict(self) -> dict[str, Any]:
        """The on-disk structure (plain types and tensors only)."""
        return {
            "format": FORMAT,
            "model": self.model_spec.to_dict(),
            "state_dict": {k: v.detach().cpu() for k, v in self.state_dict.items()},
            "head": self.head.to_dict(),
            "meta": copy.deepcopy(self.meta),
            "extra": {k: v.detach().cpu() for k, v in self.extra.items()},
        }

    @classmethod
    def from_dict(cls, obj: object, where: str = "checkpoint") -> Checkpoint:
        """Parse and validate the on-disk structure."""
        d = as_type(STR_MAP, obj, where)
        tag = d.get("format")
        if tag != FORMAT:
            raise CheckpointError(
                f"{where}: format tag is {tag!r}, expected {FORMAT!r} "
                "(not an edgefl agent checkpoint?)"
            )
        return cls(
            model_spec=ModelSpec.from_dict(required(d, "model", object, where), f"{where}.model"),
            state_dict=tensor_map(required(d, "state_dict", object, where), f"{where}.state_dict"),
            head=HeadSpec.from_dict(required(d, "head", object, where), f"{where}.head"),
            meta=check_meta(required(d, "meta", object, where), f"{where}.meta"),
            extra=tensor_map(d.get("extra", {}), f"{where}.extra"),
        )


def save_checkpoint(path: str | os.PathLike[str], ckpt: Checkpoint) -> Path:
    """Write ``ckpt`` atomically: a temporary file in the same directory, then ``os.replace``.

    A crash mid-write leaves the previous checkpoint intact, never a truncated file.

    Returns:
        The path written.
    """
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    obj = ckpt.to_dict()
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        Path(tmp).replace(dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read and validate a checkpoint with ``weights_only=True`` (no code can run).

    Raises:
        CheckpointError: The file is missing, not a ``torch.save`` archive, truncated, holds
            Python objects beyond plain types and tensors, has another format tag, or misses
            or mistypes a key. The message names the file and the offending key.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint not found: {p}")
    if not p.is_file():
        raise CheckpointError(f"checkpoint is not a file: {p}")
    # torch.save writes a zip archive; checking first gives "truncated" instead of torch's
    # misleading "weights only load failed" for random or cut-off bytes.
    if not zipfile.is_zipfile(p):
        raise CheckpointError(
            f"{p}: not a torch.save archive (corrupt, truncated or another file type)"
        )
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError, KeyError
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        if found:
            raise CheckpointError(
                f"{p}: holds a pickled Python object ({found.group(1)}); agent checkpoints "
                "contain only plain types and tensors and are loaded with weights_only=True"
            ) from exc
        raise CheckpointError(f"{p}: unreadable torch archive ({first_line(exc)})") from exc
    return Checkpoint.from_dict(obj, where=str(p))


def build_model(ckpt: Checkpoint) -> Classifier:
    """Rebuild the declared architecture and load the weights with ``strict=True``.

    Returns:
        The model in eval mode on the CPU.

    Raises:
        CheckpointError: The architecture cannot be built, or the state dict does not fit it;
            the message lists missing, unexpected and shape-mismatched keys.
    """
    from models._registry import create_model

    spec = ckpt.model_spec
    try:
        model = create_model(spec.name, **spec.create_kwargs())
    except EdgeFLError as exc:
        raise CheckpointError(f"checkpoint model {spec.name!r} cannot be built: {exc}") from exc
    check_state_dict(model.state_dict(), ckpt.state_dict, spec)
    try:
        model.load_state_dict(ckpt.state_dict, strict=True)
    except RuntimeError as exc:  # e.g. dtype trouble the key/shape check above cannot see
        raise CheckpointError(
            f"state_dict does not load into {spec.name}: {first_line(exc)}"
        ) from exc
    return model.eval()


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
