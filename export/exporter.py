"""Export a classifier with its inference head to one ONNX file (timm's ONNX path, split in two).

The trunk (``forward_features``) and the head are exported separately with the same torch
exporter and opset, then joined at the ``features`` tensor (see :mod:`export.heads` for why).
The result has input ``input`` ``[batch, C, H, W]`` float32 in [0, 1] and outputs ``scores``
``[batch, num_classes]`` float32 and ``label`` ``[batch]`` int64.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import Tensor, nn

from export._defaults import DEFAULT_DYNAMO, DEFAULT_OPSET
from export._graph import (
    BATCH_DIM,
    FEATURES,
    INPUT,
    OUTPUTS,
    check_model,
    name_batch_dim,
    prune_opsets,
    save_atomic,
    set_metadata,
    strip_debug_info,
)
from export.heads import InferenceModel, with_head
from models import Classifier
from models.checkpoint import HeadSpec, file_sha256, toolkit_version
from models.trace_guard import TRACE_GUARD
from protocol.errors import ExportError

__all__ = ["DEFAULT_DYNAMO", "DEFAULT_OPSET", "PIXEL_SCALING", "ExportResult", "export_model"]

PIXEL_SCALING = "[0,1] float, normalisation inside the graph"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# onnxscript's optimiser logs a dozen INFO lines per export; an agent logging at INFO should
# not show them. Quietened only while exporting, and only where the user set no level.
_CHATTY_LOGGERS = ("onnxscript", "onnx_ir")


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_model` wrote.

    Attributes:
        path: The ONNX file.
        sha256: Its SHA-256.
        size_bytes: Its size.
        opset: Default-domain opset of the graph.
        exporter: ``"dynamo"`` or ``"legacy"``.
        input_shape: ``(C, H, W)``; the batch dimension is dynamic.
        head_type: ``"logits"``, ``"prototype"`` or ``"cosine"``.
        num_classes: Width of ``scores``.
        seconds: Wall time of the export.
        metadata: The ``metadata_props`` written into the file.
    """

    path: Path
    sha256: str
    size_bytes: int
    opset: int
    exporter: str
    input_shape: tuple[int, int, int]
    head_type: str
    num_classes: int
    seconds: float
    metadata: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        out = asdict(self)
        out["path"] = str(self.path)
        out["input_shape"] = list(self.input_shape)
        return out


def export_model(
    model: Classifier,
    head: HeadSpec,
    out_path: str | os.PathLike[str],
    *,
    input_shape: Sequence[int],
    opset: int = DEFAULT_OPSET,
    dynamo: bool = DEFAULT_DYNAMO,
    metadata: Mapping[str, str] | None = None,
) -> ExportResult:
    """Export ``model`` with the inference ``head`` to ``out_path`` (written atomically).

    Args:
        model: The classifier; exported in eval mode, its train/eval mode is restored after.
        head: The head the algorithm predicts with (baked in as constants).
        out_path: Destination ``.onnx`` file.
        input_shape: ``(C, H, W)`` of one image.
        opset: Default-domain ONNX opset (see ``DEFAULT_OPSET``).
        dynamo: True for torch's ``torch.export`` exporter, False for the legacy one.
        metadata: Extra ``metadata_props`` (class names, algorithm, source hash, ...); keys
            here override the exporter's own.

    Returns:
        The file's path, hash, size and the settings used.

    Raises:
        ExportError: torch cannot export the model (e.g. an unsupported op), the head does not
            fit the model, the exporter produced another opset, or the checker rejects it.
    """
    shape = _image_shape(input_shape)
    start = time.perf_counter()
    was_training = model.training
    exporter = "dynamo" if dynamo else "legacy"
    try:
        wrapper = _WithFeatures(with_head(model, head)).eval()
        # A private generator: exporting must not advance the caller's global RNG stream.
        gen = torch.Generator().manual_seed(0)
        # Batch 2: torch.export specialises dimensions of size 1, which would pin the batch.
        example = torch.rand(2, *shape, generator=gen)
        example = example.to(next((p.device for p in model.parameters()), example.device))
        with tempfile.TemporaryDirectory(prefix="edgefl-export-") as tmp:
            merged = _torch_export(wrapper, example, Path(tmp, "model.onnx"), opset, dynamo)
    finally:
        model.train(was_training)
    # `features` was exported as a third output only to name the trunk/head boundary (variants
    # split there); the deliverable has two outputs, and `features` stays an internal tensor.
    name_batch_dim(merged)
    strip_debug_info(merged)
    outputs = list(merged.graph.output)
    del merged.graph.output[:]
    merged.graph.output.extend(o for o in outputs if o.name != FEATURES)
    merged.graph.value_info.extend(o for o in outputs if o.name == FEATURES)
    prune_opsets(merged)
    num_classes = int(merged.graph.output[0].type.tensor_type.shape.dim[1].dim_value)
    props = {
        "input_name": INPUT,
        "input_shape": json.dumps([BATCH_DIM, *shape]),
        "in_chans": str(shape[0]),
        "pixel_scaling": PIXEL_SCALING,
        "outputs": f"scores [batch, {num_classes}] float32; label [batch] int64 (argmax)",
        "head_type": head.type,
        "num_classes": str(num_classes),
        "precision": "fp32",
        "opset": str(opset),
        "exporter": f"torch.onnx {exporter} (torch {torch.__version__})",
        "toolkit_version": toolkit_version(),
        **dict(metadata or {}),
    }
    set_metadata(merged, props)
    path = save_atomic(merged, out_path)
    check_model(path)
    return ExportResult(
        path=path,
        sha256=file_sha256(path),
        size_bytes=path.stat().st_size,
        opset=opset,
        exporter=exporter,
        input_shape=shape,
        head_type=head.type,
        num_classes=num_classes,
        seconds=time.perf_counter() - start,
        metadata=props,
    )


def _image_shape(input_shape: Sequence[int]) -> tuple[int, int, int]:
    dims = tuple(input_shape)
    if len(dims) != 3 or not all(isinstance(d, int) and d >= 1 for d in dims):
        raise ExportError(f"input_shape: expected (C, H, W) positive ints, got {input_shape!r}")
    return dims[0], dims[1], dims[2]


class _WithFeatures(nn.Module):
    """The inference model returning ``(scores, label, features)``: one torch export (dynamo
    costs seconds per call) that still names the trunk/head boundary."""

    def __init__(self, inner: InferenceModel) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Images -> scores, label, features."""
        features = self.inner.trunk(x)
        scores, label = self.inner.head(features)
        return scores, label, features


def _torch_export(
    module: nn.Module, example: Tensor, path: Path, opset: int, dynamo: bool
) -> onnx.ModelProto:
    """Run one torch exporter on ``module`` and load the result; foreign errors -> ExportError."""
    input_name, output_names = INPUT, (*OUTPUTS, FEATURES)
    what = f"{_model_name(module)} with torch.onnx ({'dynamo' if dynamo else 'legacy'} exporter)"
    try:
        # The legacy exporter prints the TorchScript graph to stdout when it fails; the error
        # raised below carries the cause, so the dump is kept off the CLI's output.
        with (
            TRACE_GUARD.tracing(),  # tracing state is process-wide: see models.trace_guard
            _quiet_loggers(),
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
        ):
            # The legacy exporter's deprecation notice is noise when legacy was asked for;
            # TracerWarnings (data-dependent control flow) still show.
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            # what differs between the exporters: how the batch axis is declared, and their
            # own graph clean-up switches
            specific: dict[str, Any] = (
                {
                    "external_data": False,
                    "dynamic_shapes": ({0: torch.export.Dim.DYNAMIC},),
                    "optimize": True,
                    "verbose": False,
                }
                if dynamo
                else {
                    "dynamic_axes": {n: {0: BATCH_DIM} for n in (input_name, *output_names)},
                    "do_constant_folding": True,
                }
            )
            torch.onnx.export(
                module,
                (example,),
                path,
                input_names=[input_name],
                output_names=list(output_names),
                opset_version=opset,
                dynamo=dynamo,
                **specific,
            )
    except ModuleNotFoundError as exc:
        raise ExportError(
            f"cannot export {what}: missing module {exc.name!r} (the dynamo exporter needs "
            "onnxscript; or use the legacy exporter)"
        ) from exc
    except Exception as exc:  # torch.onnx/torch.export raise many unrelated types
        raise ExportError(f"cannot export {what}: {_first_line(exc)}") from exc
    model = onnx.load(os.fspath(path))
    got = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if got != opset:
        raise ExportError(
            f"{what} produced opset {got} instead of the requested {opset} (the dynamo "
            "exporter cannot convert below 18 reliably: use opset 18 or the legacy exporter)"
        )
    return model


@contextlib.contextmanager
def _quiet_loggers() -> Iterator[None]:
    """WARNING for the exporter's chatty loggers that have no level of their own, then NOTSET."""
    quietened = [
        logger
        for logger in map(logging.getLogger, _CHATTY_LOGGERS)
        if logger.level == logging.NOTSET
    ]
    for logger in quietened:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger in quietened:
            logger.setLevel(logging.NOTSET)


def _model_name(module: nn.Module) -> str:
    inner = getattr(getattr(getattr(module, "inner", None), "trunk", None), "model", None)
    name = getattr(inner, "model_name", None)
    return str(name) if name else type(inner or module).__name__


def _first_line(exc: BaseException) -> str:
    """The first line of the root cause (dynamo wraps it in generic "step 3/3" errors)."""
    chain = [exc]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 10:
        chain.append(nxt)
    for err in reversed(chain):
        lines = [ln.strip() for ln in _ANSI.sub("", str(err)).splitlines() if ln.strip()]
        if lines:
            text = f"{type(err).__name__}: {lines[0]}"
            return text if len(text) <= 300 else text[:297] + "..."
    return type(exc).__name__
