"""Registry-driven tests of every classifier: shapes, split interface, projection, seeding.

A new architecture is tested the moment it is registered. Heavy networks (more than a few
million parameters) run only at 32 px, batch 2, to keep the suite within a couple of minutes
on two CPU cores.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models import Classifier, create_model, list_models, model_info

# Cheap enough to run at every size; everything else runs at 32 px only.
LIGHT = (
    set(list_models(family="mlp"))
    | set(list_models(family="cnn"))
    | {"resnet4", "resnet6", "resnet8", "resnet10", "mobilenet_v3_small", "shufflenet_v2"}
)
SIZES = (8, 28, 32, 64)
ALL = list_models()


def _sizes(name: str) -> list[int]:
    cfg = model_info(name)
    sizes = SIZES if name in LIGHT else (32,)
    return [s for s in sizes if cfg.supports(s)]


def _build(name: str, **kwargs: object) -> Classifier:
    kwargs.setdefault("input_size", 32 if model_info(name).supports(32) else None)
    return create_model(name, num_classes=5, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ALL)
def test_forward_shapes(name: str) -> None:
    """Logits [2, 5] for 1- and 3-channel inputs at every supported size."""
    for size in _sizes(name):
        for chans in (1, 3):
            model = create_model(name, num_classes=5, in_chans=chans, input_size=size)
            logits = model(torch.rand(2, chans, size, size))
            assert logits.shape == (2, 5), (size, chans)
            assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", ALL)
def test_split_interface(name: str) -> None:
    """forward == forward_head(forward_features); pre_logits; get/reset_classifier."""
    # Prepare
    model = _build(name).eval()
    x = torch.rand(2, 3, *model.input_size)

    # Execute
    with torch.no_grad():
        features = model.forward_features(x)
        logits = model(x)

    # Assert
    assert features.shape == (2, model.num_features)
    assert model.num_features == model.trunk_dim
    torch.testing.assert_close(model.forward_head(features), logits)
    assert model.forward_head(features, pre_logits=True) is features
    head = model.get_classifier()
    assert isinstance(head, nn.Linear) and head.in_features == model.num_features
    model.reset_classifier(3)
    assert model.num_classes == 3 and model(x).shape == (2, 3)
    model.reset_classifier(0)
    assert model(x).shape == (2, model.num_features)


@pytest.mark.parametrize("name", ALL)
def test_feature_dim_projection_and_seeded_determinism(name: str) -> None:
    """feature_dim adds Linear(native, D); the same seed builds the same weights."""
    # Prepare / Execute
    torch.manual_seed(123)
    first = _build(name, feature_dim=24)
    torch.manual_seed(123)
    second = _build(name, feature_dim=24)

    # Assert
    assert first.num_features == 24
    assert isinstance(first.proj, nn.Linear) and first.proj.in_features == first.trunk_dim
    head = first.get_classifier()
    assert isinstance(head, nn.Linear) and (head.in_features, head.out_features) == (24, 5)
    for (key, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), key
    x = torch.rand(2, 3, *first.input_size)
    first.eval()
    second.eval()
    with torch.no_grad():
        assert first.forward_features(x).shape == (2, 24)
        torch.testing.assert_close(first(x), second(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(LIGHT))
def test_backward_reaches_every_parameter(name: str) -> None:
    model = _build(name, in_chans=1, feature_dim=8, input_size=model_info(name).input_size)
    x = torch.rand(2, 1, *model.input_size)
    model(x).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing


def test_tiny_kinds_match_spec_widths_at_8px() -> None:
    """fedvtc.md §10.1: MLP 64→64, MLP 64→128, flatten widths 128, 256, 256 at 8×8."""
    widths = {
        name: create_model(name, num_classes=10, in_chans=1, input_size=8).trunk_dim
        for name in ("mlp_s", "mlp_m", "cnn_t1", "cnn_t2", "cnn_t3")
    }
    assert widths == {"mlp_s": 64, "mlp_m": 128, "cnn_t1": 128, "cnn_t2": 256, "cnn_t3": 256}


def test_cnn4_matches_fedktl_flatten() -> None:
    """fedktl.md §5.4: the 4-layer CNN flattens 1600 values at 32×32 before FC 512."""
    model = create_model("cnn4", num_classes=10, input_size=32)
    first_fc = next(m for m in model.trunk.modules() if isinstance(m, nn.Linear))
    assert (first_fc.in_features, first_fc.out_features) == (1600, 512)
    assert model.num_features == 512


@pytest.mark.parametrize(
    ("name", "dim"),
    [("resnet4", 64), ("resnet6", 128), ("resnet8", 256), ("resnet10", 512), ("resnet50", 2048)],
)
def test_resnet_native_dims(name: str, dim: int) -> None:
    assert _build(name).num_features == dim


def test_resnet_depths_follow_spec() -> None:
    """felo_velo.md §5.1 block counts."""
    expected = {
        "resnet10": [1, 1, 1, 1],
        "resnet14": [1, 2, 2, 1],
        "resnet18": [2, 2, 2, 2],
        "resnet22": [2, 3, 3, 2],
        "resnet26": [3, 3, 3, 3],
        "resnet34": [3, 4, 6, 3],
    }
    for name, blocks in expected.items():
        trunk = _build(name).trunk
        got = [len(getattr(trunk, f"layer{i}")) for i in range(1, 5)]
        assert got == blocks, name


def test_small_stem_switch() -> None:
    small = create_model("resnet10", num_classes=2, input_size=32)
    large = create_model("resnet10", num_classes=2, input_size=32, small_stem=False)
    big_input = create_model("resnet10", num_classes=2, input_size=64)
    kernels = [m.get_submodule("trunk.conv1").kernel_size for m in (small, large, big_input)]
    assert kernels == [(3, 3), (7, 7), (7, 7)]
    assert isinstance(small.get_submodule("trunk.maxpool"), nn.Identity)


def test_feature_act_relu_makes_features_non_negative() -> None:
    model = create_model("mlp_m", num_classes=4, in_chans=1, feature_dim=8, feature_act="relu")
    assert (model.forward_features(torch.rand(2, 1, 8, 8)) >= 0).all()


def test_fedtype_toy_proxy_has_2410_parameters() -> None:
    """fedtype.md §10: the MLP 64→32→10 proxy has 2,410 parameters."""
    proxy = create_model("mlp_xs", num_classes=10, in_chans=1, input_size=8)
    assert sum(p.numel() for p in proxy.parameters()) == 2410


@pytest.mark.parametrize(("name", "millions"), [("resnet18", 11.17), ("mobilenet_v1", 3.21)])
def test_fedtype_proxy_sizes_match_paper(name: str, millions: float) -> None:
    """fedtype.md §5: CIFAR ResNet-18 11.17 M and MobileNet-V1 3.21 M parameters (C = 10)."""
    model = create_model(name, num_classes=10, input_size=32)
    count = sum(p.numel() for p in model.parameters()) / 1e6
    assert count == pytest.approx(millions, rel=0.01)
