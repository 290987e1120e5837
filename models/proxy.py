"""FedType's small shared proxy architectures (fedtype.md §5 and §10).

* ``resnet18`` at 32 px is already the CIFAR ResNet-18 proxy (3×3 stride-1 stem, no max-pool,
  BasicBlock [2,2,2,2], global pool, 512-d).
* ``mobilenet_v1`` (registered here): the CIFAR MobileNet-V1, a 3×3 conv of 32 channels, then
  13 depthwise-separable blocks [64, (128,s2), 128, (256,s2), 256, (512,s2), 512×5, (1024,s2),
  1024], global average pool, 1024-d.
* ``shufflenet_v2`` and ``efficientnet_b0`` (torchvision, see :mod:`models.tv_nets`).
* ``mlp_xs`` (64→32, see :mod:`models.small`): the toy proxy of the CPU reproduction.
"""

from __future__ import annotations

from torch import nn

from models._classifier import Classifier
from models._registry import ModelArgs, register_model

__all__ = ["PROXY_MODELS", "mobilenet_v1"]

PROXY_MODELS: tuple[str, ...] = (
    "resnet18",
    "shufflenet_v2",
    "mobilenet_v1",
    "efficientnet_b0",
    "mlp_xs",
)

# (out_channels, stride) of the 13 depthwise-separable blocks.
_MOBILENET_V1_CFG: tuple[tuple[int, int], ...] = (
    (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2),
    (512, 1), (512, 1), (512, 1), (512, 1), (512, 1), (1024, 2), (1024, 1),
)  # fmt: skip


def _conv_bn(cin: int, cout: int, k: int, stride: int, groups: int = 1) -> list[nn.Module]:
    return [
        nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    ]


@register_model(family="mobilenet", input_size=32, min_input_size=8)
def mobilenet_v1(args: ModelArgs, *, width_mult: float = 1.0) -> Classifier:
    """MobileNet-V1, CIFAR variant (FedType's alternative proxy), 1024-d features."""
    first = max(8, int(32 * width_mult))
    layers = _conv_bn(args.in_chans, first, 3, 1)
    cin = first
    for channels, stride in _MOBILENET_V1_CFG:
        cout = max(8, int(channels * width_mult))
        layers += _conv_bn(cin, cin, 3, stride, groups=cin) + _conv_bn(cin, cout, 1, 1)
        cin = cout
    trunk = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
    return args.classifier(trunk, cin)
