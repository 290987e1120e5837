"""onnxruntime sessions for verification, accuracy and latency, with provider bookkeeping.

ORT does not fail when a requested execution provider is unavailable: asking for CUDA without a
GPU (or with the CPU-only wheel) logs a warning and runs on the CPU. Every session here
therefore reports the providers it *actually* got (``session.get_providers()``) next to the
ones requested.

On a machine with onnxruntime-gpu and a GPU, the TensorRT and CUDA providers get explicit
options (:func:`provider_options`): TensorRT builds an engine per model and input shape, which
takes seconds to minutes, so its engine and timing caches are on and kept beside the model.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from export._graph import OUTPUTS
from protocol.errors import ExportError

__all__ = [
    "DEFAULT_PROVIDERS",
    "Session",
    "check_images",
    "latency_ms",
    "make_session",
    "provider_options",
    "run_batches",
]

DEFAULT_PROVIDERS = ("CPUExecutionProvider",)
TRT_CACHE_DIR = "trt_cache"


def provider_options(provider: str, cache_dir: str | os.PathLike[str]) -> dict[str, str]:
    """ORT options for ``provider``: TensorRT engine/timing cache in ``cache_dir``; CUDA device 0.

    Other providers get ``{}`` (ORT's defaults). TensorRT's fp16 mode stays off: precision is
    chosen by the file (``model.fp16.onnx``), so one file always computes the same way.
    """
    if provider == "TensorrtExecutionProvider":
        cache = os.fspath(cache_dir)
        return {
            "device_id": "0",
            "trt_engine_cache_enable": "True",
            "trt_engine_cache_path": cache,
            "trt_timing_cache_enable": "True",
            "trt_timing_cache_path": cache,
        }
    if provider == "CUDAExecutionProvider":
        return {"device_id": "0", "cudnn_conv_algo_search": "HEURISTIC"}
    return {}


@dataclass(frozen=True)
class Session:
    """An ORT session with the providers requested and the providers in use."""

    session: ort.InferenceSession
    requested: tuple[str, ...]
    used: tuple[str, ...]
    warnings: tuple[str, ...]

    @property
    def input_name(self) -> str:
        """Name of the graph input."""
        return str(self.session.get_inputs()[0].name)


def make_session(
    path: str | os.PathLike[str],
    providers: Sequence[str] | None = None,
    *,
    threads: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Session:
    """Open ``path`` with ``providers`` (default CPU); CPU is appended as the explicit fallback.

    Args:
        path: ONNX file.
        providers: Execution provider names in priority order.
        threads: ``intra_op_num_threads`` (None: ORT's default, all physical cores).
        cache_dir: TensorRT engine cache (default: ``trt_cache`` beside ``path``); used only
            when the TensorRT provider is requested and available.

    Raises:
        ExportError: An unknown provider name, or ORT cannot load or run the graph.
    """
    requested = tuple(providers) if providers else DEFAULT_PROVIDERS
    unknown = [p for p in requested if p not in ort.get_all_providers()]
    if unknown:
        raise ExportError(
            f"unknown execution provider(s) {unknown}; available here: "
            f"{ort.get_available_providers()}"
        )
    names = [*requested, *(p for p in DEFAULT_PROVIDERS if p not in requested)]
    cache = Path(cache_dir) if cache_dir is not None else Path(path).parent / TRT_CACHE_DIR
    available = set(ort.get_available_providers())
    # Options only for providers this build has: ORT drops unavailable ones with a warning.
    chain: list[str | tuple[str, dict[str, Any]]] = [
        (p, opts) if p in available and (opts := provider_options(p, cache)) else p for p in names
    ]
    if "TensorrtExecutionProvider" in available and "TensorrtExecutionProvider" in requested:
        cache.mkdir(parents=True, exist_ok=True)
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: fallback warnings are captured below
    if threads is not None:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            session = ort.InferenceSession(os.fspath(path), sess_options=options, providers=chain)
    except Exception as exc:  # ORT raises its own Fail/InvalidGraph/NotImplemented types
        raise ExportError(f"onnxruntime cannot load {path}: {_one_line(exc)}") from exc
    return Session(
        session,
        requested,
        tuple(session.get_providers()),
        tuple(_one_line(w.message) for w in caught),
    )


def run_batches(
    sess: Session, images: np.ndarray, batch_size: int = 64
) -> tuple[np.ndarray, np.ndarray]:
    """``scores [N, C]`` and ``label [N]`` of ``images`` run in batches."""
    scores, labels = [], []
    for start in range(0, len(images), batch_size):
        batch = np.ascontiguousarray(images[start : start + batch_size])
        try:
            # By name, as a deployment calls it: a variant with other names fails here.
            s, lab = sess.session.run(list(OUTPUTS), {sess.input_name: batch})
        except Exception as exc:  # ORT runtime failure (kernel missing, shape error)
            raise ExportError(f"onnxruntime failed to run the model: {_one_line(exc)}") from exc
        scores.append(np.asarray(s))
        labels.append(np.asarray(lab))
    return np.concatenate(scores), np.concatenate(labels)


def latency_ms(
    sess: Session, image_shape: Sequence[int], *, batch: int = 1, repeats: int = 50, warmup: int = 5
) -> float:
    """Median wall time of one ``run`` on a ``[batch, *image_shape]`` input, in ms."""
    x = np.random.default_rng(0).random((batch, *image_shape), dtype=np.float32)
    feed = {sess.input_name: x}
    for _ in range(warmup):
        sess.session.run(None, feed)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sess.session.run(None, feed)
        times.append(time.perf_counter() - t0)
    return 1000.0 * statistics.median(times)


def check_images(
    images: np.ndarray, image_shape: Sequence[int], what: str = "samples"
) -> np.ndarray:
    """Validate ``[N, C, H, W]`` images in [0, 1] for ``image_shape`` and return them float32.

    Raises:
        ExportError: Wrong rank or shape, no samples, non-finite values, or values outside
            [0, 1] (e.g. uint8 pixels that were not divided by 255).
    """
    arr = np.asarray(images)
    want = tuple(image_shape)
    if arr.ndim != 4 or tuple(arr.shape[1:]) != want:
        raise ExportError(
            f"{what}: expected shape [N, {', '.join(map(str, want))}], got {list(arr.shape)}"
        )
    if len(arr) == 0:
        raise ExportError(f"{what}: no samples")
    arr = arr.astype(np.float32, copy=False)
    if not np.isfinite(arr).all():
        raise ExportError(f"{what}: contains NaN or infinite values")
    lo, hi = float(arr.min()), float(arr.max())
    if lo < -1e-6 or hi > 1.0 + 1e-6:
        raise ExportError(
            f"{what}: values must be images scaled to [0, 1] (normalisation is inside the model), "
            f"got range [{lo:g}, {hi:g}]"
        )
    return arr


def _one_line(obj: object, limit: int = 300) -> str:
    text = " ".join(str(obj).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
