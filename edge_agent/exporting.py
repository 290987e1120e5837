"""The end of a run on the device: the final model, and each extra model its algorithm names
(:meth:`~edge_agent.algorithms.EdgeAlgorithm.extra_exports`), as verified ONNX bundles.

The device's own model comes from its best round's checkpoint where it keeps one (a run with
``hyper.validation_fraction``), else from its last (``models/selection.py``). The metrics
returned here go into the final reply (``onnx_exported``, ``onnx_bytes``, ``onnx_verified``,
...; ``export_round``: the round exported; ``onnx_NAME_*`` for an extra model). An extra
bundle that fails costs only that bundle: the main one is already written.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from models.checkpoint import Checkpoint, save_checkpoint
from models.selection import choose

__all__ = ["EXPORT_NAME", "bundle_metrics", "export_models"]

EXPORT_NAME = re.compile(r"[a-z0-9_]{1,32}")  # a directory, a file stem and a metric key


def export_models(
    checkpoint: Path,
    export_dir: Path,
    samples: tuple[Any, Any],
    extras: Mapping[str, Checkpoint],
    *,
    meta: dict[str, Any],
    state_dir: Path,
    log: logging.Logger,
) -> dict[str, float]:
    """Export the best checkpoint beside the last one, ``checkpoint`` (the last itself when
    there is none), with its inference head to ``export_dir`` and verify it on ``samples``
    (images, labels); then each of ``extras`` into ``export_dir/NAME``."""
    from export import export_bundle  # lazy: onnx is only needed at the end of a run

    chosen = choose(checkpoint, "best")
    log.info("exporting round %s: %s", chosen.round, chosen.note)
    manifest = export_bundle(
        chosen.path, export_dir, samples=samples[0], labels=samples[1], selection=chosen.to_dict()
    )
    out = bundle_metrics("onnx", manifest, export_dir, log)
    if chosen.round is not None:
        out["export_round"] = float(chosen.round)
    for name, ckpt in extras.items():
        dest = export_dir / name
        out.update(
            _export_extra(name, ckpt, dest, samples, meta=meta, state_dir=state_dir, log=log)
        )
    return out


def _export_extra(
    name: str,
    ckpt: Checkpoint,
    dest: Path,
    samples: tuple[Any, Any],
    *,
    meta: dict[str, Any],
    state_dir: Path,
    log: logging.Logger,
) -> dict[str, float]:
    """``state_dir/NAME.ckpt`` exported to ``dest``; a failure costs only this bundle."""
    from export import export_bundle

    key = f"onnx_{name}"
    try:
        if not EXPORT_NAME.fullmatch(name):
            raise ValueError(f"extra export name {name!r}: expected [a-z0-9_]{{1,32}}")
        # the run's record (round, classes, ...) with what the algorithm says of this model
        ckpt = dataclasses.replace(ckpt, meta={**meta, **ckpt.meta})
        path = state_dir / f"{name}.ckpt"
        save_checkpoint(path, ckpt)
        manifest = export_bundle(path, dest, samples=samples[0], labels=samples[1])
    except Exception as exc:  # the main bundle is already written: keep its result
        log.error("ONNX export of %s failed: %s: %s", name, type(exc).__name__, exc)
        return {f"{key}_exported": 0.0}
    return bundle_metrics(key, manifest, dest, log)


def bundle_metrics(key: str, manifest: Any, where: Path, log: logging.Logger) -> dict[str, float]:
    """The reply's metrics of one bundle: exported, its fp32 file's size, and the verification."""
    fp32 = manifest.files[0]
    log.info("exported %s (%d bytes) to %s", fp32.file, fp32.size_bytes, where)
    out = {f"{key}_exported": 1.0, f"{key}_bytes": float(fp32.size_bytes)}
    if fp32.verification is not None:
        out[f"{key}_verified"] = float(fp32.verification.passed)
        out[f"{key}_argmax_agreement"] = float(fp32.verification.agreement)
        out[f"{key}_max_abs_diff"] = float(fp32.verification.max_abs_diff)
    return out
