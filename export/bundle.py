"""Deployment bundle: checkpoint -> ``model.onnx`` (+ variants) + ``manifest.json``.

The manifest records, per file, its hash and size, how it was verified against PyTorch
(on real samples or, when none were given, on random [0, 1] noise, and says which), its accuracy
next to fp32 when labels are given, its batch-1 latency and the execution providers used.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from export.exporter import DEFAULT_DYNAMO, DEFAULT_OPSET, ExportResult, export_model
from export.heads import InferenceModel, with_head
from export.runtime import check_images, latency_ms, make_session, run_batches
from export.variants import MAX_CALIBRATION, VARIANT_FILES, VARIANTS, Variant, make_variant
from export.verify import (
    FP32_TOLERANCE,
    InputKind,
    Tolerance,
    VerifyReport,
    compare_onnx,
    verify_onnx,
)
from models.checkpoint import Checkpoint, build_model, file_sha256, load_checkpoint, toolkit_version
from protocol.errors import ExportError

__all__ = ["MANIFEST_FORMAT", "VARIANT_TOLERANCES", "Manifest", "VariantRecord", "export_bundle"]

MANIFEST_FORMAT = "edgefl.bundle/1"
# fp32 must match PyTorch (a failure raises). Reduced precision is compared against the fp32
# PyTorch model and *reported*: its ``passed`` flag uses these indicative bounds, and the
# accuracy drop on labelled data is the figure that decides deployment.
VARIANT_TOLERANCES: dict[str, Tolerance] = {
    "fp32": FP32_TOLERANCE,
    "fp16": Tolerance(atol=1e-2, rtol=1e-2, min_agreement=0.99),
    "int8-static": Tolerance(atol=0.5, rtol=0.1, min_agreement=0.95),
    "int8-dynamic": Tolerance(atol=0.5, rtol=0.1, min_agreement=0.95),
}
RANDOM_SAMPLES = 64


@dataclass(frozen=True)
class VariantRecord:
    """One file of the bundle.

    Attributes:
        variant: ``fp32``, ``fp16``, ``int8-static`` or ``int8-dynamic``.
        file: File name inside the bundle directory.
        sha256: SHA-256 of the file.
        size_bytes: Its size.
        verification: Comparison with PyTorch, or None when verification was skipped.
        accuracy: Accuracy on the labelled samples, or None without labels.
        accuracy_drop: fp32 accuracy minus this one, in percentage points.
        latency_ms_b1: Median batch-1 latency on the session's providers.
        providers_used: Execution providers the session actually got.
    """

    variant: str
    file: str
    sha256: str
    size_bytes: int
    verification: VerifyReport | None
    accuracy: float | None
    accuracy_drop: float | None
    latency_ms_b1: float
    providers_used: list[str]


@dataclass(frozen=True)
class Manifest:
    """The bundle's ``manifest.json`` as written.

    Attributes:
        path: ``manifest.json``.
        source: Checkpoint path and SHA-256.
        model: The checkpoint's model spec.
        export: Exporter settings and timing of the fp32 file.
        verification_inputs: ``"real"``, ``"random"`` or ``"none"`` (verification skipped).
        num_samples: Samples used for verification/accuracy.
        providers_requested: Execution providers asked for.
        files: One record per variant, fp32 first.
        calibration: How ``int8-static`` was calibrated (source, image count, method), or
            empty when it was not written.
        metadata: The ONNX ``metadata_props`` of the fp32 file.
        metrics: The checkpoint's own metrics (training-time evaluation).
        checkpoint: Which of a device's checkpoints this is and its round
            (:class:`models.selection.Selection`; empty when the caller did not choose).
    """

    path: Path
    source: dict[str, str]
    model: dict[str, Any]
    export: dict[str, Any]
    verification_inputs: str
    num_samples: int
    providers_requested: list[str]
    files: list[VariantRecord]
    calibration: dict[str, Any]
    metadata: dict[str, str]
    metrics: dict[str, float]
    checkpoint: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (non-finite floats become strings)."""
        data = asdict(self)
        data.pop("path")
        return {"format": MANIFEST_FORMAT, "toolkit_version": toolkit_version(), **_finite(data)}

    def record(self, variant: str) -> VariantRecord:
        """The record of one variant (KeyError if absent)."""
        for rec in self.files:
            if rec.variant == variant:
                return rec
        raise KeyError(variant)


def export_bundle(
    checkpoint_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    variants: Sequence[str] = ("fp32",),
    verify: bool = True,
    providers: Sequence[str] | None = None,
    samples: np.ndarray | None = None,
    labels: np.ndarray | None = None,
    calibration: np.ndarray | None = None,
    opset: int = DEFAULT_OPSET,
    dynamo: bool = DEFAULT_DYNAMO,
    selection: Mapping[str, Any] | None = None,
) -> Manifest:
    """Export a checkpoint to ``out_dir/model.onnx`` plus variants and ``manifest.json``.

    Args:
        checkpoint_path: An agent checkpoint (:mod:`models.checkpoint`).
        out_dir: Bundle directory (created).
        variants: Any of ``fp32`` (always written), ``fp16``, ``int8-static``,
            ``int8-dynamic``.
        verify: Compare every file with PyTorch; an fp32 mismatch raises.
        providers: ORT execution providers for verification and timing (default CPU).
        samples: ``[N, C, H, W]`` images in [0, 1] from the agent's data; without them
            verification uses uniform random inputs and the manifest says so.
        labels: ``[N]`` class indices of ``samples`` for accuracy figures.
        calibration: Images for ``int8-static`` calibration (default: ``samples``); pass
            training images here when ``samples`` is a held-out test set.
        opset: ONNX opset.
        dynamo: torch exporter (True: dynamo, False: legacy).
        selection: Which of the device's checkpoints ``checkpoint_path`` is, and its round
            (``Selection.to_dict()``): recorded in the manifest and the ONNX metadata.

    Returns:
        The manifest, also written to ``out_dir/manifest.json``.

    Raises:
        CheckpointError: The checkpoint is missing, corrupt, or does not fit its architecture.
        ExportError: Export, conversion or verification failed, or bad samples/labels.
    """
    chosen = _variants(variants)
    source = Path(checkpoint_path)
    ckpt = load_checkpoint(source)
    model = build_model(ckpt)
    spec = ckpt.model_spec
    shape = (spec.in_chans, *spec.input_size)
    x, y, kind = _inputs(samples, labels, shape, spec.num_classes)
    calib = (
        check_images(calibration, shape, "calibration")
        if calibration is not None
        else (x if kind == "real" else None)
    )
    if "int8-static" in chosen and calib is None:
        raise ExportError(
            "int8-static needs calibration samples from the agent's data "
            "(--data file.npz); without data use int8-dynamic"
        )
    sha = file_sha256(source)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = export_model(
        model,
        ckpt.head,
        out / VARIANT_FILES["fp32"],
        input_shape=shape,
        opset=opset,
        dynamo=dynamo,
        metadata={
            **_metadata(ckpt, sha),
            **({"checkpoint": json.dumps(dict(selection))} if selection else {}),
        },
    )
    reference = with_head(model, ckpt.head)
    records: list[VariantRecord] = []
    for variant in chosen:
        path = (
            result.path
            if variant == "fp32"
            else make_variant(variant, result.path, out / VARIANT_FILES[variant], calibration=calib)
        )
        fp32_acc = records[0].accuracy if records else None
        records.append(
            _record(
                variant,
                path,
                reference=reference,
                x=x,
                y=y,
                kind=kind,
                verify=verify,
                providers=providers,
                fp32_acc=fp32_acc,
            )
        )
    manifest = Manifest(
        path=out / "manifest.json",
        source={"checkpoint": str(source), "sha256": sha},
        model=spec.to_dict(),
        export=_export_info(result),
        verification_inputs=kind if verify else "none",
        num_samples=len(x),
        providers_requested=list(providers or ["CPUExecutionProvider"]),
        files=records,
        calibration=_calibration_info(calib, calibration is not None)
        if "int8-static" in chosen
        else {},
        metadata=result.metadata,
        metrics={k: float(v) for k, v in ckpt.meta.get("metrics", {}).items()},
        checkpoint=dict(selection or {}),
    )
    _write_json(manifest.path, manifest.to_dict())
    return manifest


def _record(
    variant: Variant,
    path: Path,
    *,
    reference: InferenceModel,
    x: np.ndarray,
    y: np.ndarray | None,
    kind: InputKind,
    verify: bool,
    providers: Sequence[str] | None,
    fp32_acc: float | None,
) -> VariantRecord:
    report: VerifyReport | None = None
    if verify and variant == "fp32":
        report = verify_onnx(path, reference, x, providers=providers, inputs=kind)
    elif verify:
        report = compare_onnx(
            path,
            reference,
            x,
            tolerance=VARIANT_TOLERANCES[variant],
            providers=providers,
            inputs=kind,
        )
    sess = make_session(path, providers)
    accuracy = None
    if y is not None:
        _, pred = run_batches(sess, x)
        accuracy = float(np.mean(pred == y))
    drop = None if accuracy is None or fp32_acc is None else 100.0 * (fp32_acc - accuracy)
    return VariantRecord(
        variant=variant,
        file=path.name,
        sha256=file_sha256(path),
        size_bytes=path.stat().st_size,
        verification=report,
        accuracy=accuracy,
        accuracy_drop=drop,
        latency_ms_b1=latency_ms(sess, x.shape[1:], repeats=30),
        providers_used=list(sess.used),
    )


def _variants(variants: Sequence[str]) -> list[Variant]:
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ExportError(f"unknown variant(s) {unknown}; known: {list(VARIANTS)}")
    # fp32 always comes first: the variants are derived from it and compared with it.
    return ["fp32", *(v for v in VARIANTS[1:] if v in variants)]  # type: ignore[list-item]


def _inputs(
    samples: np.ndarray | None, labels: np.ndarray | None, shape: tuple[int, ...], num_classes: int
) -> tuple[np.ndarray, np.ndarray | None, InputKind]:
    if samples is None:
        if labels is not None:
            raise ExportError("labels given without samples")
        rng = np.random.default_rng(0)
        return rng.random((RANDOM_SAMPLES, *shape), dtype=np.float32), None, "random"
    x = check_images(samples, shape)
    if labels is None:
        return x, None, "real"
    y = np.asarray(labels)
    if y.shape != (len(x),) or not np.issubdtype(y.dtype, np.integer):
        raise ExportError(
            f"labels: expected {len(x)} integer class indices, got {y.dtype} {list(y.shape)}"
        )
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        raise ExportError(
            f"labels: values must lie in [0, {num_classes}), got [{y.min()}, {y.max()}]"
        )
    return x, y.astype(np.int64), "real"


def _metadata(ckpt: Checkpoint, sha: str) -> dict[str, str]:
    """ONNX ``metadata_props`` describing where the model came from."""
    meta, spec = ckpt.meta, ckpt.model_spec
    names = list(meta.get("class_names") or [str(i) for i in range(spec.num_classes)])
    if len(names) != spec.num_classes:
        raise ExportError(f"meta.class_names: {len(names)} names for {spec.num_classes} classes")
    return {
        "model_name": spec.name,
        "class_names": json.dumps(names),
        # The graph applies this itself (first op of the trunk): feed [0, 1] pixels, never
        # pre-normalised ones. Recorded so that a deployment can check its preprocessing.
        "normalization": json.dumps(
            None
            if spec.mean is None or spec.std is None
            else {"mean": list(spec.mean), "std": list(spec.std)}
        ),
        "algorithm": str(meta.get("algorithm", "")),
        "round": str(meta.get("round", "")),
        "federation": str(meta.get("federation", "")),
        "run_id": str(meta.get("run_id", "")),
        "device_id": str(meta.get("device_id", "")),
        "source_sha256": sha,
        "source_toolkit_version": str(meta.get("toolkit_version", "")),
        "metrics": json.dumps(meta.get("metrics", {}), sort_keys=True),
    }


def _calibration_info(calib: np.ndarray | None, separate: bool) -> dict[str, Any]:
    return {
        "source": "calibration" if separate else "samples",
        "num_samples": min(len(calib), MAX_CALIBRATION) if calib is not None else 0,
        "method": "MinMax activation ranges, per-channel int8 weights, QDQ",
    }


def _export_info(result: ExportResult) -> dict[str, Any]:
    return {
        "opset": result.opset,
        "exporter": result.exporter,
        "input_shape": list(result.input_shape),
        "head_type": result.head_type,
        "num_classes": result.num_classes,
        "seconds": round(result.seconds, 3),
    }


def _finite(obj: Any) -> Any:
    """Replace inf/NaN (invalid JSON) by their string names, recursively."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)
