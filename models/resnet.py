"""ResNets built with torchvision's ``ResNet`` class (never with downloaded weights).

Depth variants (felo_velo.md §5.1, fedktl.md §5.4): BasicBlock ResNet4/6/8 = [1], [1,1],
[1,1,1] (the missing stages removed, so their features are 64/128/256-d), ResNet10 = [1,1,1,1],
14 = [1,2,2,1], 18 = [2,2,2,2], 22 = [2,3,3,2], 26 = [3,3,3,3], 34 = [3,4,6,3]; Bottleneck
ResNet50/101/152 (2048-d features).

Stem: for inputs of at most 32 px the 7×7 stride-2 stem and the max-pool are replaced by a 3×3
stride-1 convolution without max-pool (the usual CIFAR adaptation; fedtype.md §5's proxy),
otherwise 32×32 images reach the last stage as 1×1 maps. ``small_stem=False`` keeps the
ImageNet stem, as FedKTL's HtFE models use it on 32×32 inputs.
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from models._classifier import Classifier
from models._registry import ModelArgs, register_model

__all__ = [
    "resnet4",
    "resnet6",
    "resnet8",
    "resnet10",
    "resnet14",
    "resnet18",
    "resnet22",
    "resnet26",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
]

_STAGE_NAMES = ("layer1", "layer2", "layer3", "layer4")
_SMALL_INPUT = 32


def use_small_stem(args: ModelArgs, small_stem: bool | None) -> bool:
    """Resolve ``small_stem=None`` to "inputs of at most 32 px get the CIFAR-style stem"."""
    return max(args.input_size) <= _SMALL_INPUT if small_stem is None else small_stem


def _create_resnet(
    args: ModelArgs,
    block_name: Literal["BasicBlock", "Bottleneck"],
    layers: tuple[int, ...],
    small_stem: bool | None,
    zero_init_residual: bool,
) -> Classifier:
    # imported here, not at module level: torchvision costs ~1 s and ~100 MiB at start-up,
    # which devices building other families should not pay
    from torchvision.models import resnet as tv_resnet

    block = getattr(tv_resnet, block_name)
    # torchvision's ResNet always has four stages; shallower variants drop the tail stages.
    padded = list(layers) + [1] * (4 - len(layers))
    net = tv_resnet.ResNet(block, padded, zero_init_residual=zero_init_residual)
    for name in _STAGE_NAMES[len(layers) :]:
        setattr(net, name, nn.Identity())
    if use_small_stem(args, small_stem):
        net.conv1 = nn.Conv2d(args.in_chans, 64, 3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    elif args.in_chans != 3:
        net.conv1 = nn.Conv2d(args.in_chans, 64, 7, stride=2, padding=3, bias=False)
    nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
    net.fc = nn.Identity()
    dim = 64 * 2 ** (len(layers) - 1) * block.expansion
    return args.classifier(net, dim)


@register_model(family="resnet", input_size=32, min_input_size=8)
def resnet4(
    args: ModelArgs, *, small_stem: bool | None = None, zero_init_residual: bool = False
) -> Classifier:
    """ResNet-4, BasicBlock [1], 64-d features."""
    return _create_resnet(args, "BasicBlock", (1,), small_stem, zero_init_residual)


@register_model(family="resnet", input_size=32, min_input_size=8)
def resnet6(
    args: ModelArgs, *, small_stem: bool | None = None, zero_init_residual: bool = False
) -> Classifier:
    """ResNet-6, BasicBlock [1, 1], 128-d features."""
    return _create_resnet(args, "BasicBlock", (1, 1), small_stem, zero_init_residual)


@register_model(family="resnet", input_size=32, min_input_size=8)
def resnet8(
    args: ModelArgs, *, small_stem: bool | None = None, zero_init_residual: bool = False
) -> Classifier:
    """ResNet-8, BasicBlock [1, 1, 1], 256-d features."""
    return _create_resnet(args, "BasicBlock", (1, 1, 1), small_stem, zero_init_residual)


@register_model(family="resnet", input_size=32, min_input_size=8)
def resnet10(
    args: ModelArgs, *, small_stem: bool | None = None, zero_init_residual: bool = False
) -> Classifier:
    """ResNet-10, BasicBlock [1, 1, 1, 1], 512-d features."""
    return _create_resnet(args, "BasicBlock", (1, 1, 1, 1), small_stem, zero_init_residual)


@register_model(family="resnet", input_size=32, min_input_size=8)
def resnet14(
    args: ModelArgs, *, small_stem: bool | None = None, zero_init_residual: bool = False
) -> Classifier:
    """ResNet-14, BasicBlock [1, 2, 2, 1], 512-d features."""
    return _create_resnet(args, "BasicBlock", (1, 2, 2, 1), small_stem, zero_init_residual)


@register_model(family="resnet", input_size=32, min_input_size=8)
def resnet18(
    args: ModelArgs, *, small_stem: bool | None = None, zero_init_residual: bool = False
) -> Classifier:
    """ResNet-18, BasicBlock [2, 2, 2, 2], 512-d features."""
    return _create_resnet(args, "BasicBlock", (2, 2, 2, 2), small_stem, zero_init_residual)


@register_model(family="resnet", input_size=32, min_input_size=8)
def resnet22(
    args: ModelArgs, *, small_stem: bool | None = None, zero_init_residual: bool = False
) -> Classifier:
    """ResNet-22, BasicBlock [2, 3, 3, 2], 512-d features."""
    return _create_resnet(args, "BasicBlock", (2, 3, 3, 2), small_stem, zero_init_residual)


@register_model(family="resnet", input_size=32, min_input_size=8)
def resnet26(
    args: ModelArgs, *, small_stem: bool | None = None, zero_init_residual: bool = False
) -> Classifier:
    """ResNet-26, BasicBlock [3, 3, 3, 3], 512-d features."""
    return _create_resnet(args, "BasicBlock", (3, 3, 3, 3), small_stem, zero_init_residual)


@register_model(family="resnet", input_size=32, min_input_size=8)
def resnet34(
    args: ModelArgs, *, small_stem: bool | None = None, zero_init_residual: bool = False
) -> Classifier:
    """ResNet-34, BasicBlock [3, 4, 6, 3], 512-d features."""
    return _create_resnet(args, "BasicBlock", (3, 4, 6, 3), small_stem, zero_init_residual)


@register_model(family="resnet", input_size=32, min_input_size=8)
def resnet50(
    args: ModelArgs, *, small_stem: bool | None = None, zero_init_residual: bool = False
) -> Classifier:
    """ResNet-50, Bottleneck [3, 4, 6, 3], 2048-d features."""
    return _create_resnet(args, "Bottleneck", (3, 4, 6, 3), small_stem, zero_init_residual)


@register_model(family="resnet", input_size=32, min_input_size=8)
def resnet101(
    args: ModelArgs, *, small_stem: bool | None = None, zero_init_residual: bool = False
) -> Classifier:
    """ResNet-101, Bottleneck [3, 4, 23, 3], 2048-d features."""
    return _create_resnet(args, "Bottleneck", (3, 4, 23, 3), small_stem, zero_init_residual)


@register_model(family="resnet", input_size=32, min_input_size=8)
def resnet152(
    args: ModelArgs, *, small_stem: bool | None = None, zero_init_residual: bool = False
) -> Classifier:
    """ResNet-152, Bottleneck [3, 8, 36, 3], 2048-d features."""
    return _create_resnet(args, "Bottleneck", (3, 8, 36, 3), small_stem, zero_init_residual)
