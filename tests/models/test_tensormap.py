"""A module's state dict as a TensorMap and back (``models.tensormap``), used by the edge's
weight exchange and the coordinator's server-trained modules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models import create_model
from models.tensormap import load_tensormap, module_to_tensormap
from protocol.contract.payloads import TensorMap
from protocol.errors import ValidationError


def test_tensormap_round_trip_carries_bn_buffers_exactly() -> None:
    # Prepare: a BN model whose buffers moved
    src = create_model("cnn_bn3", num_classes=4, in_chans=1, feature_dim=16, input_size=8)
    src.train()
    src(torch.rand(6, 1, 8, 8))
    dst = create_model("cnn_bn3", num_classes=4, in_chans=1, feature_dim=16, input_size=8)
    # Execute
    tm = module_to_tensormap(src)
    load_tensormap(dst, tm, "payloads.weights")
    # Assert
    assert any(k.endswith("num_batches_tracked") for k in tm.tensors)
    for k, v in dst.state_dict().items():
        assert torch.equal(v, src.state_dict()[k]), k
    counter = next(k for k in tm.tensors if k.endswith("num_batches_tracked"))
    assert dst.state_dict()[counter].dtype == torch.int64


def test_load_tensormap_names_the_field_on_a_wrong_name_or_shape() -> None:
    net = create_model("cnn_t1", num_classes=4, in_chans=1, feature_dim=16, input_size=8)
    good = module_to_tensormap(net).tensors
    missing = dict(good)
    name = next(iter(missing))
    del missing[name]
    with pytest.raises(ValidationError, match=r"payloads\.weights: .*missing") as err:
        load_tensormap(net, TensorMap(missing), "payloads.weights")
    assert name in str(err.value)
    wrong = {**good, name: np.zeros((1, *good[name].shape), np.float32)}
    with pytest.raises(ValidationError) as err:
        load_tensormap(net, TensorMap(wrong), "payloads.weights")
    assert err.value.field == f"payloads.weights.{name}"
