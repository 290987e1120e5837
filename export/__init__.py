"""ONNX export of a trained agent model with its inference head, verification, variants, bundle.

Public names resolve lazily (PEP 562) so that ``import export`` and ``edge-export --help`` do
not import torch, onnx or onnxruntime (several seconds and ~1 GB before any work is done).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from export._graph import read_metadata
    from export.bundle import Manifest, VariantRecord, export_bundle
    from export.exporter import DEFAULT_DYNAMO, DEFAULT_OPSET, ExportResult, export_model
    from export.heads import InferenceModel, make_head, with_head
    from export.variants import VARIANTS, make_variant
    from export.verify import (
        Tolerance,
        VerificationError,
        VerifyReport,
        compare_onnx,
        verify_onnx,
    )

__all__ = [
    "DEFAULT_DYNAMO",
    "DEFAULT_OPSET",
    "VARIANTS",
    "ExportResult",
    "InferenceModel",
    "Manifest",
    "Tolerance",
    "VariantRecord",
    "VerificationError",
    "VerifyReport",
    "compare_onnx",
    "export_bundle",
    "export_model",
    "make_head",
    "make_variant",
    "read_metadata",
    "verify_onnx",
    "with_head",
]

_WHERE = {
    "DEFAULT_DYNAMO": "export.exporter",
    "DEFAULT_OPSET": "export.exporter",
    "ExportResult": "export.exporter",
    "export_model": "export.exporter",
    "InferenceModel": "export.heads",
    "make_head": "export.heads",
    "with_head": "export.heads",
    "Manifest": "export.bundle",
    "VariantRecord": "export.bundle",
    "export_bundle": "export.bundle",
    "VARIANTS": "export.variants",
    "make_variant": "export.variants",
    "Tolerance": "export.verify",
    "VerificationError": "export.verify",
    "VerifyReport": "export.verify",
    "compare_onnx": "export.verify",
    "verify_onnx": "export.verify",
    "read_metadata": "export._graph",
}


def __getattr__(name: str) -> Any:
    """Import the module defining ``name`` on first access."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'export' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later accesses skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
