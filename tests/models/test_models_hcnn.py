"""HtFLlib's heterogeneous CNN family, layer by layer against HtFLlib's ``CNN``/``FedAvgCNN``.

The reference figures come from instantiating HtFLlib's own classes (TsingZ0/HtFLlib at
e959261, ``system/flcore/trainmodel/models.py``) through its ``BaseHeadSplit`` for
``in_features=1``, 28×28 inputs, 10 classes and ``feature_dim=512``, outside this project.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models import create_model, family_models

# name -> (HtFLlib model string of system/main.py's "HCNNs8", its parameter count)
HTFLLIB = {
    "hcnn1": ("CNN(num_cov=1, hidden_dims=[])", 2_365_770),
    "cnn4": ("CNN(num_cov=2, hidden_dims=[]) = FedAvgCNN(dim=1024)", 582_026),
    "hcnn1_512": ("CNN(num_cov=1, hidden_dims=[512])", 2_628_426),
    "hcnn2_512": ("CNN(num_cov=2, hidden_dims=[512])", 844_682),
    "hcnn1_1024": ("CNN(num_cov=1, hidden_dims=[1024])", 5_250_378),
    "hcnn2_1024": ("CNN(num_cov=2, hidden_dims=[1024])", 1_631_626),
    "hcnn1_1024_512": ("CNN(num_cov=1, hidden_dims=[1024, 512])", 5_513_034),
    "hcnn2_1024_512": ("CNN(num_cov=2, hidden_dims=[1024, 512])", 1_894_282),
}
# name -> (convolutions, hidden widths): HtFLlib's num_cov and hidden_dims
LAYOUT = {
    "hcnn1": (1, ()),
    "cnn4": (2, ()),
    "hcnn1_512": (1, (512,)),
    "hcnn2_512": (2, (512,)),
    "hcnn1_1024": (1, (1024,)),
    "hcnn2_1024": (2, (1024,)),
    "hcnn1_1024_512": (1, (1024, 512)),
    "hcnn2_1024_512": (2, (1024, 512)),
}


def _build(name: str) -> nn.Module:
    return create_model(name, num_classes=10, in_chans=1, input_size=28)


def _htfllib_shapes(convs: int, hidden: tuple[int, ...]) -> list[tuple[int, ...]]:
    """HtFLlib's parameter shapes in order: 5×5 convs of 32/64 channels, FCs, the head."""
    shapes: list[tuple[int, ...]] = []
    cin, side = 1, 28
    for cout in (32, 64)[:convs]:
        shapes += [(cout, cin, 5, 5), (cout,)]
        cin, side = cout, (side - 4) // 2
    width = cin * side * side
    for units in (*hidden, 512):
        shapes += [(units, width), (units,)]
        width = units
    return [*shapes, (10, 512), (10,)]


@pytest.mark.parametrize("name", sorted(HTFLLIB))
def test_parameter_count_equals_htfllib(name: str) -> None:
    model = _build(name)
    assert sum(p.numel() for p in model.parameters()) == HTFLLIB[name][1]


@pytest.mark.parametrize("name", sorted(LAYOUT))
def test_layers_match_htfllib_in_order(name: str) -> None:
    model = _build(name)
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert shapes == _htfllib_shapes(*LAYOUT[name])


@pytest.mark.parametrize("name", sorted(LAYOUT))
def test_features_are_512_post_relu(name: str) -> None:
    """The features are the output of the trunk's last Linear -> ReLU, before the head."""
    model = _build(name).eval()
    trunk = list(model.trunk)
    assert isinstance(trunk[-1], nn.ReLU) and isinstance(trunk[-2], nn.Linear)
    assert model.num_features == 512 and isinstance(model.proj, nn.Identity)
    with torch.no_grad():
        feats = model.forward_features(torch.rand(4, 1, 28, 28))
        logits = model(torch.rand(4, 1, 28, 28))
    assert feats.shape == (4, 512) and logits.shape == (4, 10)
    assert bool((feats >= 0).all())


def test_families_assign_round_robin_like_htfllib() -> None:
    """HtFLlib's BaseHeadSplit gives client i args.models[i % len(args.models)]."""
    eight = list(HTFLLIB)
    assert family_models("hcnns8", 20) == [eight[i % 8] for i in range(20)]
    four = ["hcnn1", "cnn4", "hcnn1_1024", "hcnn2_1024"]
    assert family_models("htfl_cnn", 20) == [four[i % 4] for i in range(20)]
    assert family_models("homo_cnn4", 3) == ["cnn4"] * 3
