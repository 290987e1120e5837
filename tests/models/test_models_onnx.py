"""ONNX export of every small classifier, the VTC generator and a FedKTL model.

Uses the legacy exporter (``dynamo=False``) with a dynamic batch axis and checks onnxruntime
against PyTorch within 1e-4. The product's export path lives in ``export/``; this only proves
that every registered small architecture is exportable as built.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from models import attach_etf_head, create_model, etf_matrix, list_models, model_info, vtc_for

ort = pytest.importorskip("onnxruntime")

# The legacy exporter is deprecated in torch >= 2.9 but is the documented choice here.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SMALL = sorted(
    set(list_models(family="mlp"))
    | set(list_models(family="cnn"))
    | {"resnet4", "resnet8", "resnet10", "mobilenet_v3_small", "shufflenet_v2", "mobilenet_v1"}
)


def _round_trip(model: nn.Module, x: torch.Tensor, path: Path) -> None:
    model.eval()
    torch.onnx.export(
        model,
        (x[:1],),
        str(path),
        input_names=["input"],
        output_names=["output"],
        dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        want = model(x).numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", SMALL)
def test_small_classifier_exports(name: str, tmp_path: Path) -> None:
    size = model_info(name).input_size
    model = create_model(name, num_classes=10, in_chans=1, feature_dim=16, mean=(0.5,), std=(0.25,))
    _round_trip(model, torch.rand(3, 1, *size), tmp_path / "m.onnx")


def test_vtc_generator_exports(tmp_path: Path) -> None:
    gen = vtc_for(980, 1, 28)
    gen(torch.randn(4, 980))  # non-trivial BN running statistics
    _round_trip(gen, torch.randn(3, 980), tmp_path / "vtc.onnx")


def test_ktl_inference_model_exports(tmp_path: Path) -> None:
    model = create_model("cnn_gap", num_classes=10, in_chans=1, feature_dim=32)
    attach_etf_head(model, etf_matrix(10, generator=torch.Generator().manual_seed(0)))
    _round_trip(model, torch.rand(3, 1, 8, 8), tmp_path / "ktl.onnx")
