"""Registry behaviour: listing, metadata, validation, errors, families."""

from __future__ import annotations

import pytest
import torch

import models
from models import ModelArgs, create_model, family_models, list_families, model_info
from protocol.errors import ConfigError


def test_list_models_sorted_and_filtered() -> None:
    # Execute
    names = models.list_models()
    resnets = models.list_models("resnet*")

    # Assert
    assert names == sorted(names)
    assert {"mlp_s", "mlp_m", "cnn2", "cnn4", "cnn_t1", "cnn_t2", "cnn_t3"} <= set(names)
    assert resnets and all(n.startswith("resnet") for n in resnets)
    assert {"mlp_m", "mlp_s"} <= set(models.list_models(family="mlp"))
    assert all(model_info(n).family == "mlp" for n in models.list_models(family="mlp"))


def test_is_model_and_info() -> None:
    cfg = model_info("cnn_t1")
    assert models.is_model("cnn_t1") and not models.is_model("cnn_t9")
    assert cfg.name == "cnn_t1" and cfg.family == "cnn" and cfg.input_size == (8, 8)
    assert cfg.module == "models.small" and cfg.description
    assert cfg.supports(8) and not model_info("cnn4").supports(8)


def test_unknown_name_lists_close_matches() -> None:
    with pytest.raises(ConfigError, match=r"resnet18"):
        create_model("resnet19", num_classes=10)
    with pytest.raises(ConfigError, match=r"unknown model 'zzz'"):
        model_info("zzz")


def test_duplicate_registration_raises() -> None:
    with pytest.raises(ConfigError, match="registered twice"):

        @models.register_model(family="mlp")
        def mlp_s(args: ModelArgs) -> models.Classifier:  # pragma: no cover - never built
            raise NotImplementedError


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_classes": -1}, "num_classes"),
        ({"num_classes": 10, "in_chans": 0}, "in_chans"),
        ({"num_classes": 10, "feature_dim": 0}, "feature_dim"),
        ({"num_classes": 10, "input_size": (8,)}, "input_size"),
        ({"num_classes": 10, "mean": (0.5,)}, "together"),
        ({"num_classes": 10, "mean": (0.5, 0.5), "std": (1, 1), "in_chans": 3}, "mean"),
        ({"num_classes": 10, "mean": (0.5,), "std": (0.0,)}, "std"),
        ({"num_classes": 10, "bogus": 1}, "invalid model arguments"),
        ({"num_classes": 10, "feature_act": "gelu"}, "feature_act"),
    ],
)
def test_invalid_arguments_raise_config_error(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        create_model("mlp_s", **kwargs)  # type: ignore[arg-type]


def test_input_below_minimum_raises() -> None:
    with pytest.raises(ConfigError, match="minimum"):
        create_model("cnn4", num_classes=10, input_size=8)


def test_create_kwargs_rebuild_same_architecture() -> None:
    # Prepare
    model = create_model("cnn_t2", num_classes=7, in_chans=1, feature_dim=16, input_size=28)

    # Execute
    again = create_model(model.model_name or "", **model.create_kwargs)

    # Assert
    assert model.model_name == "cnn_t2"
    assert again.state_dict().keys() == model.state_dict().keys()
    assert all(
        a.shape == b.shape
        for a, b in zip(again.state_dict().values(), model.state_dict().values(), strict=True)
    )


def test_normalisation_is_first_op_and_not_persistent() -> None:
    # Prepare
    plain = create_model("mlp_s", num_classes=3, in_chans=1)
    normed = create_model("mlp_s", num_classes=3, in_chans=1, mean=(0.5,), std=(0.25,))
    normed.load_state_dict(plain.state_dict())
    x = torch.rand(2, 1, 8, 8)

    # Execute / Assert
    assert "normalize.mean" not in normed.state_dict()
    torch.testing.assert_close(normed(x), plain((x - 0.5) / 0.25))


def test_rgb_statistics_collapse_for_greyscale() -> None:
    model = create_model(
        "cnn_t1", num_classes=3, in_chans=1, mean=(0.4, 0.5, 0.6), std=(0.2, 0.2, 0.2)
    )
    assert model.create_kwargs["mean"] == pytest.approx((0.5,))


def test_families_round_robin() -> None:
    assert {"tiny", "htfe8", "fedvtc", "felo", "felo_extreme"} <= set(list_families())
    assert family_models("tiny", 7) == [
        "mlp_s",
        "cnn_t1",
        "cnn_t2",
        "mlp_m",
        "cnn_t3",
        "mlp_s",
        "cnn_t1",
    ]
    assert family_models("felo_extreme", 5) == [
        "resnet10",
        "resnet18",
        "resnet26",
        "resnet34",
        "resnet50",
    ]
    assert family_models("htfe8", 8)[1:3] == ["googlenet", "mobilenet_v2"]
    for family in list_families():
        assert all(models.is_model(n) for n in family_models(family, 10))


def test_family_errors() -> None:
    with pytest.raises(ConfigError, match="unknown model family"):
        family_models("nope", 3)
    with pytest.raises(ConfigError, match="num_clients"):
        family_models("tiny", 0)
