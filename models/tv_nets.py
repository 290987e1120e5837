"""Mobile and Inception networks built with torchvision constructors (``weights=None``).

``googlenet`` (aux logits off), ``mobilenet_v2``, ``mobilenet_v3_small``, ``shufflenet_v2``
(x1.0) and ``efficientnet_b0``. Each keeps torchvision's body; the original classifier is
removed (with its dropout: regularisation is the training loop's business) and the first
convolution is rebuilt for ``in_chans``. For inputs of at most 32 px (``small_stem=None``) the
stem's stride-2 convolution becomes stride 1 and GoogLeNet/ShuffleNet drop their stem max-pool,
so 32×32 images do not reach the last stage as 1×1 maps.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from models._classifier import Classifier
from models._registry import ModelArgs, register_model
from models.resnet import use_small_stem

__all__ = ["efficientnet_b0", "googlenet", "mobilenet_v2", "mobilenet_v3_small", "shufflenet_v2"]


def _tvm() -> Any:
    """torchvision's model zoo, imported when a network is built: importing torchvision costs
    ~1 s and ~100 MiB, which a device running a small CNN should not pay."""
    from torchvision import models

    return models


def _rebuild_conv(conv: nn.Conv2d, in_chans: int, small: bool) -> nn.Conv2d:
    """A fresh copy of the stem ``conv`` taking ``in_chans`` inputs, stride 1 when ``small``."""
    stride = 1 if small else conv.stride
    new = nn.Conv2d(
        in_chans,
        conv.out_channels,
        conv.kernel_size,  # type: ignore[arg-type]
        stride=stride,  # type: ignore[arg-type]
        padding=conv.padding,  # type: ignore[arg-type]
        bias=conv.bias is not None,
    )
    nn.init.kaiming_normal_(new.weight, mode="fan_out")
    if new.bias is not None:
        nn.init.zeros_(new.bias)
    return new


@register_model(family="googlenet", input_size=32, min_input_size=8)
def googlenet(args: ModelArgs, *, small_stem: bool | None = None) -> Classifier:
    """GoogLeNet (Inception v1) without auxiliary classifiers, 1024-d features."""
    from torchvision.models.googlenet import BasicConv2d

    net = _tvm().googlenet(weights=None, aux_logits=False, init_weights=True)
    small = use_small_stem(args, small_stem)
    if small:
        net.conv1 = BasicConv2d(args.in_chans, 64, kernel_size=3, stride=1, padding=1)
        net.maxpool1 = nn.Identity()  # type: ignore[assignment]
    elif args.in_chans != 3:
        net.conv1 = BasicConv2d(args.in_chans, 64, kernel_size=7, stride=2, padding=3)
    net.dropout = nn.Identity()  # type: ignore[assignment]
    net.fc = nn.Identity()  # type: ignore[assignment]
    return args.classifier(net, 1024)


@register_model(family="mobilenet", input_size=32, min_input_size=8)
def mobilenet_v2(
    args: ModelArgs, *, small_stem: bool | None = None, width_mult: float = 1.0
) -> Classifier:
    """MobileNetV2, 1280-d features."""
    net = _tvm().mobilenet_v2(weights=None, width_mult=width_mult)
    stem = net.features[0][0]
    net.features[0][0] = _rebuild_conv(stem, args.in_chans, use_small_stem(args, small_stem))
    net.classifier = nn.Identity()  # type: ignore[assignment]
    return args.classifier(net, net.last_channel)


@register_model(family="mobilenet", input_size=32, min_input_size=8)
def mobilenet_v3_small(args: ModelArgs, *, small_stem: bool | None = None) -> Classifier:
    """MobileNetV3-Small, features after its 1024-unit pre-classifier layer."""
    net = _tvm().mobilenet_v3_small(weights=None)
    stem = net.features[0][0]
    net.features[0][0] = _rebuild_conv(stem, args.in_chans, use_small_stem(args, small_stem))
    # Keep Linear(576, 1024) + Hardswish (part of the representation), drop dropout and fc.
    dim = net.classifier[0].out_features
    net.classifier = nn.Sequential(net.classifier[0], net.classifier[1])
    return args.classifier(net, dim)


@register_model(family="shufflenet", input_size=32, min_input_size=8)
def shufflenet_v2(args: ModelArgs, *, small_stem: bool | None = None) -> Classifier:
    """ShuffleNetV2 x1.0, 1024-d features."""
    net = _tvm().shufflenet_v2_x1_0(weights=None)
    small = use_small_stem(args, small_stem)
    net.conv1[0] = _rebuild_conv(net.conv1[0], args.in_chans, small)
    if small:
        net.maxpool = nn.Identity()  # type: ignore[assignment]
    net.fc = nn.Identity()  # type: ignore[assignment]
    return args.classifier(net, 1024)


@register_model(family="efficientnet", input_size=32, min_input_size=8)
def efficientnet_b0(args: ModelArgs, *, small_stem: bool | None = None) -> Classifier:
    """EfficientNet-B0, 1280-d features."""
    net = _tvm().efficientnet_b0(weights=None)
    stem = net.features[0][0]
    net.features[0][0] = _rebuild_conv(stem, args.in_chans, use_small_stem(args, small_stem))
    net.classifier = nn.Identity()  # type: ignore[assignment]
    return args.classifier(net, 1280)
