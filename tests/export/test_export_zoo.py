"""Every registry classifier exports with the default exporter and verifies (timm-style sweep).

MLP and small-CNN families run by default; the torchvision-sized ones (ResNets, MobileNets,
...) at their 32 px default are marked ``slow``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from export_helpers import SMALL_MODELS, images

from export import DEFAULT_DYNAMO, export_model, verify_onnx, with_head
from models import create_model, list_models, model_info
from models.checkpoint import HeadSpec

ZOO = [
    pytest.param(name, marks=() if name in SMALL_MODELS else pytest.mark.slow)
    for name in list_models()
]


@pytest.mark.parametrize("name", ZOO)
def test_registry_model_exports_and_verifies(name: str, tmp_path: Path) -> None:
    cfg = model_info(name)
    shape = (cfg.in_chans, *cfg.input_size)
    # feature_dim and normalisation exercise the projection and the in-graph Normalize.
    model = create_model(name, num_classes=10, in_chans=cfg.in_chans, feature_dim=16,
                         mean=(0.5,) * cfg.in_chans, std=(0.25,) * cfg.in_chans)
    head = HeadSpec("logits")
    result = export_model(model, head, tmp_path / "m.onnx", input_shape=shape)
    assert result.exporter == ("dynamo" if DEFAULT_DYNAMO else "legacy")
    report = verify_onnx(result.path, with_head(model, head), images(8, shape))
    assert report.passed and report.agreement == 1.0
