"""HtFLlib's heterogeneous CNNs for 1-channel 28×28 images (its ``CNN`` class, family "HCNNs8").

HtFLlib (TsingZ0/HtFLlib, ``system/flcore/trainmodel/models.py``, class ``CNN``) builds
``num_cov`` unpadded 5×5 convolutions (32, then 64 channels; each ReLU and a 2×2 max-pool), a
flatten, one ``Linear -> ReLU`` per entry of ``hidden_dims`` and a final ``Linear(.., 512) ->
ReLU``, then the classifier ``fc``. Its ``BaseHeadSplit`` makes ``fc`` the head and everything
before it the feature extractor, so the features are the 512-d post-ReLU output of the last
hidden layer (the ``AdaptiveAvgPool1d(512)`` it puts in ``fc``'s place is the identity on 512
values). Here the same layers form the trunk and the head is the :class:`Classifier`'s.

Names: ``hcnn<convs>[_<hidden>...]``, e.g. ``hcnn1_1024`` is ``CNN(num_cov=1,
hidden_dims=[1024])``. ``CNN(num_cov=2, hidden_dims=[])`` is HtFLlib's ``FedAvgCNN`` with
``dim=1024``, registered once, as ``cnn4`` (:mod:`models.small`).
"""

from __future__ import annotations

from torch import nn

from models._classifier import Classifier
from models._layers import probe_output_dim
from models._registry import ModelArgs, register_model

__all__ = [
    "hcnn1",
    "hcnn1_512",
    "hcnn1_1024",
    "hcnn1_1024_512",
    "hcnn2_512",
    "hcnn2_1024",
    "hcnn2_1024_512",
]

FEATURE_DIM = 512  # HtFLlib's CNN always ends in Linear(.., 512) -> ReLU before its head
_CHANNELS = (32, 64)  # HtFLlib: 2**(i+5) output channels for convolution i


def _hcnn(args: ModelArgs, convs: int, hidden: tuple[int, ...]) -> Classifier:
    """``convs`` × (conv5x5 -> ReLU -> maxpool2), flatten, ``hidden`` + 512 as Linear -> ReLU."""
    layers: list[nn.Module] = []
    cin = args.in_chans
    for cout in _CHANNELS[:convs]:
        layers += [nn.Conv2d(cin, cout, 5), nn.ReLU(), nn.MaxPool2d(2)]
        cin = cout
    width = probe_output_dim(nn.Sequential(*layers), args.in_chans, args.input_size)
    layers.append(nn.Flatten())
    for units in (*hidden, FEATURE_DIM):
        layers += [nn.Linear(width, units), nn.ReLU()]
        width = units
    return args.classifier(nn.Sequential(*layers), FEATURE_DIM)


@register_model(family="cnn", input_size=28, in_chans=1, min_input_size=6, fixed_size=True)
def hcnn1(args: ModelArgs) -> Classifier:
    """HtFLlib CNN, conv5x5·32 -> maxpool2 -> flatten (4608 at 28×28) -> FC 512 -> ReLU."""
    return _hcnn(args, 1, ())


@register_model(family="cnn", input_size=28, in_chans=1, min_input_size=6, fixed_size=True)
def hcnn1_512(args: ModelArgs) -> Classifier:
    """HtFLlib CNN, conv5x5·32 -> maxpool2 -> flatten -> FC 512 -> FC 512 (ReLU each)."""
    return _hcnn(args, 1, (512,))


@register_model(family="cnn", input_size=28, in_chans=1, min_input_size=6, fixed_size=True)
def hcnn1_1024(args: ModelArgs) -> Classifier:
    """HtFLlib CNN, conv5x5·32 -> maxpool2 -> flatten -> FC 1024 -> FC 512 (ReLU each)."""
    return _hcnn(args, 1, (1024,))


@register_model(family="cnn", input_size=28, in_chans=1, min_input_size=6, fixed_size=True)
def hcnn1_1024_512(args: ModelArgs) -> Classifier:
    """HtFLlib CNN, conv5x5·32 -> maxpool2 -> flatten -> FC 1024 -> 512 -> 512 (ReLU each)."""
    return _hcnn(args, 1, (1024, 512))


@register_model(family="cnn", input_size=28, in_chans=1, min_input_size=16, fixed_size=True)
def hcnn2_512(args: ModelArgs) -> Classifier:
    """HtFLlib CNN, unpadded conv5x5·32/64 (flatten 1024 at 28×28) -> FC 512 -> FC 512."""
    return _hcnn(args, 2, (512,))


@register_model(family="cnn", input_size=28, in_chans=1, min_input_size=16, fixed_size=True)
def hcnn2_1024(args: ModelArgs) -> Classifier:
    """HtFLlib CNN, unpadded conv5x5·32/64 -> flatten -> FC 1024 -> FC 512 (ReLU each)."""
    return _hcnn(args, 2, (1024,))


@register_model(family="cnn", input_size=28, in_chans=1, min_input_size=16, fixed_size=True)
def hcnn2_1024_512(args: ModelArgs) -> Classifier:
    """HtFLlib CNN, unpadded conv5x5·32/64 -> flatten -> FC 1024 -> 512 -> 512 (ReLU each)."""
    return _hcnn(args, 2, (1024, 512))
