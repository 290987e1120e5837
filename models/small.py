"""Small CPU-friendly classifiers for weak devices, tests and toy reproductions.

* ``mlp_s`` / ``mlp_m``: the MLP kinds of fedvtc.md §10.1 / felo_velo.md §9 (flatten any input,
  one hidden layer of 64 or 128 units); ``mlp_xs`` (32 units, FedType's toy proxy), ``mlp_l``
  (256, 128: FedKTL's toy fleet), ``mlp_xl`` (512, 256) and ``mlp_w`` (1024: FedType's toy
  private pool).
* ``cnn_t1`` / ``cnn_t2`` / ``cnn_t3``: the three tiny CNN kinds of the same sections
  (conv3x3·8, 2×conv3x3·16, conv3x3·16; each then a 2×2 max-pool and a flatten). At 8×8 their
  flatten widths are the specs' 128 / 256 / 256; at other sizes the width follows the input.
* ``cnn_gap`` (conv·16, conv·32, global average pool) and ``cnn_t4`` (conv·32, max-pool,
  conv·64, flatten): the CNNs of fedktl.md §10; ``cnn_fc`` (conv·32, conv·64, max-pool, FC 128)
  and ``cnn_bn3`` (3×(conv·64, BN, ReLU), global average pool): fedtype.md §10's private CNNs.
* ``cnn2``: the FedAvg CNN of McMahan et al. (two 5×5 "same" convolutions of 32 and 64
  channels, each with a 2×2 max-pool, then FC 512), which runs down to 4×4 inputs.
* ``cnn4``: the "4-layer CNN" of FedKTL/FedType (HtFLlib's FedAvgCNN: the same two convolutions
  *without* padding, FC 512, then the classifier), exactly as fedktl.md §5.4 (flatten 1600 at
  32×32, 1024 at 28×28).

Networks with a flatten are fixed-size: its width is computed from ``input_size`` at
construction. ``cnn_gap`` and ``cnn_bn3`` pool globally and accept any size.
"""

from __future__ import annotations

from torch import nn

from models._classifier import Classifier
from models._layers import probe_output_dim
from models._registry import ModelArgs, register_model

__all__ = [
    "cnn2",
    "cnn4",
    "cnn_bn3",
    "cnn_fc",
    "cnn_gap",
    "cnn_t1",
    "cnn_t2",
    "cnn_t3",
    "cnn_t4",
    "mlp_l",
    "mlp_m",
    "mlp_s",
    "mlp_w",
    "mlp_xl",
    "mlp_xs",
]


def _mlp(args: ModelArgs, hidden: tuple[int, ...]) -> Classifier:
    h, w = args.input_size
    layers: list[nn.Module] = [nn.Flatten()]
    width = args.in_chans * h * w
    for units in hidden:
        layers += [nn.Linear(width, units), nn.ReLU()]
        width = units
    return args.classifier(nn.Sequential(*layers), width)


def _conv_flatten(args: ModelArgs, convs: nn.Sequential, fc: int | None = None) -> Classifier:
    """``convs -> flatten [-> Linear(flat, fc) -> ReLU]`` sized by probing ``input_size``."""
    flat = probe_output_dim(convs, args.in_chans, args.input_size)
    layers: list[nn.Module] = [*convs, nn.Flatten()]
    if fc is not None:
        layers += [nn.Linear(flat, fc), nn.ReLU()]
    return args.classifier(nn.Sequential(*layers), flat if fc is None else fc)


def _conv_relu(cin: int, cout: int, k: int = 3, pad: int = 1, bn: bool = False) -> list[nn.Module]:
    if bn:
        return [nn.Conv2d(cin, cout, k, padding=pad, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
    return [nn.Conv2d(cin, cout, k, padding=pad), nn.ReLU()]


def _gap() -> list[nn.Module]:
    # Global average pooling as a mean over H, W: exports to ONNX as ReduceMean for any size.
    return [nn.AdaptiveAvgPool2d(1), nn.Flatten()]


@register_model(family="mlp", input_size=8, in_chans=1, fixed_size=True)
def mlp_xs(args: ModelArgs, *, hidden: int = 32) -> Classifier:
    """MLP, flatten -> Linear(C·H·W, 32) -> ReLU (FedType's toy proxy, 64→32→10)."""
    return _mlp(args, (hidden,))


@register_model(family="mlp", input_size=8, in_chans=1, fixed_size=True)
def mlp_s(args: ModelArgs, *, hidden: int = 64) -> Classifier:
    """MLP, flatten -> Linear(C·H·W, 64) -> ReLU (the spec's "MLP 64→64→p" at 8×8)."""
    return _mlp(args, (hidden,))


@register_model(family="mlp", input_size=8, in_chans=1, fixed_size=True)
def mlp_m(args: ModelArgs, *, hidden: int = 128) -> Classifier:
    """MLP, flatten -> Linear(C·H·W, 128) -> ReLU (the spec's "MLP 64→128→p" at 8×8)."""
    return _mlp(args, (hidden,))


@register_model(family="mlp", input_size=8, in_chans=1, fixed_size=True)
def mlp_l(args: ModelArgs) -> Classifier:
    """MLP, flatten -> 256 -> ReLU -> 128 -> ReLU (FedKTL's toy "MLP 64→256→128→K'")."""
    return _mlp(args, (256, 128))


@register_model(family="mlp", input_size=8, in_chans=1, fixed_size=True)
def mlp_xl(args: ModelArgs) -> Classifier:
    """MLP, flatten -> 512 -> ReLU -> 256 -> ReLU (FedType's toy private "MLP 64→512→256")."""
    return _mlp(args, (512, 256))


@register_model(family="mlp", input_size=8, in_chans=1, fixed_size=True)
def mlp_w(args: ModelArgs) -> Classifier:
    """MLP, flatten -> 1024 -> ReLU (FedType's toy private "MLP 64→1024")."""
    return _mlp(args, (1024,))


@register_model(family="cnn", input_size=8, in_chans=1, min_input_size=2, fixed_size=True)
def cnn_t1(args: ModelArgs) -> Classifier:
    """Tiny CNN, conv3x3·8 -> ReLU -> maxpool2 -> flatten (128 at 8×8)."""
    convs = nn.Sequential(*_conv_relu(args.in_chans, 8), nn.MaxPool2d(2))
    return _conv_flatten(args, convs)


@register_model(family="cnn", input_size=8, in_chans=1, min_input_size=2, fixed_size=True)
def cnn_t2(args: ModelArgs) -> Classifier:
    """Tiny CNN, 2×(conv3x3·16 -> ReLU) -> maxpool2 -> flatten (256 at 8×8)."""
    convs = nn.Sequential(*_conv_relu(args.in_chans, 16), *_conv_relu(16, 16), nn.MaxPool2d(2))
    return _conv_flatten(args, convs)


@register_model(family="cnn", input_size=8, in_chans=1, min_input_size=2, fixed_size=True)
def cnn_t3(args: ModelArgs) -> Classifier:
    """Tiny CNN, conv3x3·16 -> ReLU -> maxpool2 -> flatten (256 at 8×8)."""
    convs = nn.Sequential(*_conv_relu(args.in_chans, 16), nn.MaxPool2d(2))
    return _conv_flatten(args, convs)


@register_model(family="cnn", input_size=8, in_chans=1, min_input_size=2, fixed_size=True)
def cnn_t4(args: ModelArgs) -> Classifier:
    """Tiny CNN, conv3x3·32 -> ReLU -> maxpool2 -> conv3x3·64 -> ReLU -> flatten (1024 at 8×8)."""
    convs = nn.Sequential(*_conv_relu(args.in_chans, 32), nn.MaxPool2d(2), *_conv_relu(32, 64))
    return _conv_flatten(args, convs)


@register_model(family="cnn", input_size=8, in_chans=1, min_input_size=2, fixed_size=True)
def cnn_fc(args: ModelArgs, *, fc: int = 128) -> Classifier:
    """Tiny CNN, conv3x3·32 -> conv3x3·64 -> maxpool2 -> flatten -> FC 128 -> ReLU."""
    convs = nn.Sequential(*_conv_relu(args.in_chans, 32), *_conv_relu(32, 64), nn.MaxPool2d(2))
    return _conv_flatten(args, convs, fc)


@register_model(family="cnn", input_size=8, in_chans=1)
def cnn_gap(args: ModelArgs) -> Classifier:
    """Tiny CNN, conv3x3·16 -> ReLU -> conv3x3·32 -> ReLU -> global average pool (32-d)."""
    trunk = nn.Sequential(*_conv_relu(args.in_chans, 16), *_conv_relu(16, 32), *_gap())
    return args.classifier(trunk, 32)


@register_model(family="cnn", input_size=8, in_chans=1)
def cnn_bn3(args: ModelArgs, *, width: int = 64) -> Classifier:
    """Tiny CNN, 3×(conv3x3·64 -> BN -> ReLU) -> global average pool (64-d)."""
    layers = _conv_relu(args.in_chans, width, bn=True)
    layers += _conv_relu(width, width, bn=True) + _conv_relu(width, width, bn=True)
    return args.classifier(nn.Sequential(*layers, *_gap()), width)


@register_model(family="cnn", input_size=28, in_chans=1, min_input_size=4, fixed_size=True)
def cnn2(args: ModelArgs, *, fc: int = 512) -> Classifier:
    """FedAvg CNN (McMahan et al.), 2×(conv5x5 'same' -> ReLU -> maxpool2) -> FC 512 -> ReLU."""
    convs = nn.Sequential(
        *_conv_relu(args.in_chans, 32, k=5, pad=2),
        nn.MaxPool2d(2),
        *_conv_relu(32, 64, k=5, pad=2),
        nn.MaxPool2d(2),
    )
    return _conv_flatten(args, convs, fc)


@register_model(family="cnn", input_size=32, min_input_size=16, fixed_size=True)
def cnn4(args: ModelArgs, *, fc: int = 512) -> Classifier:
    """4-layer CNN of FedKTL/FedType (HtFLlib FedAvgCNN), unpadded conv5x5·32/64 -> FC 512."""
    convs = nn.Sequential(
        *_conv_relu(args.in_chans, 32, k=5, pad=0),
        nn.MaxPool2d(2),
        *_conv_relu(32, 64, k=5, pad=0),
        nn.MaxPool2d(2),
    )
    return _conv_flatten(args, convs, fc)
