"""fp16 and int8 variants of an fp32 export.

Only the trunk (``input -> features``) is converted; the head (prototype distances, cosine,
argmax) stays float32 in every variant, see :mod:`export.heads`. Inputs and outputs keep their
float32/int64 types, so a deployment swaps files without touching its pre/post-processing.

* ``fp16``: ``onnxruntime.transformers.float16.convert_float_to_float16`` with
  ``keep_io_types=True`` (Cast nodes at the trunk's edges). Halves the size; on a CPU ORT
  inserts casts back to float32 for kernels without fp16, so it is a GPU/Jetson variant.
* ``int8-static``: QDQ, per-channel int8 weights and int8 activations whose ranges are
  calibrated (MinMax) on the agent's own images. ``quant_pre_process`` runs first (shape
  inference and Conv+BN folding; without it the quantiser sees unfused BatchNorms).
* ``int8-dynamic``: weights int8, activations quantised at run time, no calibration data.
  Small files, but dynamic int8 convolutions are several times slower on x86 CPUs.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, get_args

import numpy as np
import onnx

from export._graph import (
    INPUT,
    check_model,
    join,
    name_batch_dim,
    prune_opsets,
    save_atomic,
    set_metadata,
    split,
    toposort,
)
from protocol.errors import ExportError

__all__ = ["VARIANTS", "VARIANT_FILES", "Variant", "make_variant"]

Variant = Literal["fp32", "fp16", "int8-static", "int8-dynamic"]
VARIANTS: tuple[str, ...] = get_args(Variant)
VARIANT_FILES: dict[str, str] = {
    "fp32": "model.onnx",
    "fp16": "model.fp16.onnx",
    "int8-static": "model.int8.onnx",
    "int8-dynamic": "model.int8-dynamic.onnx",
}
# Calibration beyond a few hundred images moves MinMax ranges little and costs time.
MAX_CALIBRATION = 512
CALIBRATION_BATCH = 32


def make_variant(
    variant: Variant,
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    calibration: np.ndarray | None = None,
) -> Path:
    """Write the ``variant`` of the fp32 export ``src`` to ``dst``.

    Args:
        variant: ``"fp16"``, ``"int8-static"`` or ``"int8-dynamic"``.
        src: An fp32 file written by :func:`export.export_model`.
        dst: Destination file (written atomically).
        calibration: ``[N, C, H, W]`` images in [0, 1] for ``int8-static`` (required there).

    Returns:
        ``dst``.

    Raises:
        ExportError: Unknown variant, missing calibration data, or the conversion failed.
    """
    if variant not in VARIANTS or variant == "fp32":
        raise ExportError(f"variant: expected one of {list(VARIANTS[1:])}, got {variant!r}")
    if variant == "int8-static" and (calibration is None or len(calibration) == 0):
        raise ExportError(
            "int8-static needs calibration images from the agent's own data (random noise "
            "calibrates the wrong activation ranges); pass samples or use int8-dynamic"
        )
    model = onnx.load(os.fspath(src))
    props = {p.key: p.value for p in model.metadata_props}
    trunk, head = split(model)
    with tempfile.TemporaryDirectory(prefix="edgefl-variant-") as tmp:
        if variant == "fp16":
            trunk = _fp16(trunk)
        else:
            trunk = _int8(trunk, Path(tmp), calibration if variant == "int8-static" else None)
    out = join(trunk, head)
    name_batch_dim(out)
    prune_opsets(out)
    set_metadata(out, {**props, "precision": variant})
    path = save_atomic(out, dst)
    check_model(path)
    return path


def _fp16(trunk: onnx.ModelProto) -> onnx.ModelProto:
    try:
        from onnxruntime.transformers.float16 import convert_float_to_float16
    except ImportError as exc:
        raise ExportError(
            "fp16 needs onnxruntime.transformers.float16 (part of the onnxruntime wheel)"
        ) from exc
    try:
        converted: onnx.ModelProto = convert_float_to_float16(trunk, keep_io_types=True)
    except Exception as exc:  # converter raises ValueError/onnx errors on odd graphs
        raise ExportError(f"fp16 conversion failed: {exc}") from exc
    toposort(converted)
    return converted


def _int8(trunk: onnx.ModelProto, tmp: Path, calibration: np.ndarray | None) -> onnx.ModelProto:
    """Static QDQ int8 when ``calibration`` is given, dynamic int8 otherwise."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class _Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self, images: np.ndarray) -> None:
            self._batches = _batches(images[:MAX_CALIBRATION])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self._batches, None)

    raw, pre, out = tmp / "trunk.onnx", tmp / "trunk.pre.onnx", tmp / "trunk.int8.onnx"
    onnx.save_model(trunk, raw)
    try:
        quant_pre_process(os.fspath(raw), os.fspath(pre))
        if calibration is None:
            quantize_dynamic(pre, out, weight_type=QuantType.QInt8)
        else:
            quantize_static(
                pre,
                out,
                _Reader(calibration),
                quant_format=QuantFormat.QDQ,
                per_channel=True,
                activation_type=QuantType.QInt8,
                weight_type=QuantType.QInt8,
                calibrate_method=CalibrationMethod.MinMax,
            )
    except Exception as exc:  # onnxruntime.quantization raises assorted types
        kind = "static" if calibration is not None else "dynamic"
        raise ExportError(f"int8 {kind} quantisation failed: {exc}") from exc
    return onnx.load(os.fspath(out))


def _batches(images: np.ndarray) -> Iterator[dict[str, np.ndarray]]:
    for start in range(0, len(images), CALIBRATION_BATCH):
        chunk = images[start : start + CALIBRATION_BATCH]
        yield {INPUT: np.ascontiguousarray(chunk, dtype=np.float32)}
