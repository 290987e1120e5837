"""Every registry classifier exports with the default exporter and verifies (timm-style sweep).

Each model is built at its registry default input size (8x8 for the MLP/CNN families, 32x32
for the torchvision-sized ones). The cost is the dynamo export itself, which grows with the
number of graph nodes, not with the input size; models whose export takes more than about five
seconds on one shared CPU core are marked ``slow`` (``-m "not slow"`` skips them). A newly
registered model is swept by default.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from export_helpers import calibrate_batchnorm, images

from export import DEFAULT_DYNAMO, export_model, verify_onnx, with_head
from models import create_model, list_models, model_info
from models.checkpoint import HeadSpec

# Measured export + verify seconds (one thread, loaded 2-core machine): resnet152 28,
# resnet101 23, googlenet 18, efficientnet_b0 14, shufflenet_v2 12, resnet50 11,
# mobilenet_v2 10, mobilenet_v3_small 10, resnet34 8, resnet18/22 6, resnet26 5.5.
SLOW_MODELS = frozenset(
    {
        "resnet152",
        "resnet101",
        "resnet50",
        "resnet34",
        "resnet26",
        "resnet22",
        "resnet18",
        "googlenet",
        "efficientnet_b0",
        "shufflenet_v2",
        "mobilenet_v2",
        "mobilenet_v3_small",
    }
)
ZOO = [
    pytest.param(name, marks=pytest.mark.slow if name in SLOW_MODELS else ())
    for name in list_models()
]


def test_slow_list_names_registered_models() -> None:
    assert set(list_models()) >= SLOW_MODELS


@pytest.mark.parametrize("name", ZOO)
def test_registry_model_exports_and_verifies(name: str, tmp_path: Path) -> None:
    cfg = model_info(name)
    shape = (cfg.in_chans, *cfg.input_size)
    # feature_dim and normalisation exercise the projection and the in-graph Normalize.
    model = create_model(
        name,
        num_classes=10,
        in_chans=cfg.in_chans,
        feature_dim=16,
        mean=(0.5,) * cfg.in_chans,
        std=(0.25,) * cfg.in_chans,
    )
    calibrate_batchnorm(model, images(32, shape, seed=1))
    head = HeadSpec("logits")
    result = export_model(model, head, tmp_path / "m.onnx", input_shape=shape)
    assert result.exporter == ("dynamo" if DEFAULT_DYNAMO else "legacy")
    assert result.input_shape == shape and result.num_classes == 10
    x = images(8, shape)
    with torch.no_grad():  # the trunk must matter, or the check only compares the bias
        features = model.forward_features(torch.from_numpy(x))
    assert 1e-2 < float(features.std()) < 1e3
    report = verify_onnx(result.path, with_head(model, head), x)
    assert report.passed and report.agreement == 1.0
