"""Export defaults, in a module free of heavy imports so that the CLI's ``--help`` shows them.

Opset 18 is the dynamo exporter's native opset: onnxscript's torchlib implements ops at 18, and
on torch 2.14 a request for 17 goes through the ONNX version converter, which fails on Reduce*
nodes with axes inputs (the cosine head's ReduceL2, global average pooling) and then *silently*
keeps 18 (``export_model`` turns that into an error). The legacy exporter supports 18 too, ORT
has run it since 1.14, TensorRT 8.6+ parses it, and per-channel QDQ quantisation needs >= 13.

The dynamo exporter (``torch.export`` + onnxscript) is the default: it exports every registry
model here and matches PyTorch as closely as the legacy TorchScript exporter, which torch 2.9+
deprecates with a removal warning. Legacy stays available (much faster to export, needs only
``onnx``). Figures per model are in docs/howto/export-onnx.md.
"""

from __future__ import annotations

__all__ = ["DEFAULT_DYNAMO", "DEFAULT_OPSET"]

DEFAULT_OPSET = 18
DEFAULT_DYNAMO = True
