"""The one weighted mean of tensor maps (FedAvg, Felo's groups, FedVTC's generator)."""

import numpy as np
import pytest

from coordinator.aggregation import weighted_mean
from protocol.contract.payloads import TensorMap
from protocol.errors import AggregationError


def tm(w: float, tracked: int) -> TensorMap:
    return TensorMap(
        {
            "bn.running_mean": np.full(3, w, np.float32),
            "bn.num_batches_tracked": np.array(tracked, np.int64),
        }
    )


def test_weighted_mean_of_floats_and_max_of_integer_buffers() -> None:
    out = weighted_mean([tm(1.0, 5), tm(4.0, 9)], [3, 1])
    np.testing.assert_allclose(out.tensors["bn.running_mean"], [1.75] * 3)  # (3*1 + 4) / 4
    assert int(out.tensors["bn.num_batches_tracked"]) == 9


def test_plain_mean_without_weights() -> None:
    out = weighted_mean([tm(1.0, 1), tm(2.0, 1), tm(6.0, 1)])
    np.testing.assert_allclose(out.tensors["bn.running_mean"], [3.0] * 3)


@pytest.mark.parametrize(
    ("maps", "weights", "message"),
    [
        ([], None, "no weights"),
        ([tm(1, 1), TensorMap({"x": np.zeros(3, np.float32)})], None, "different tensor names"),
        ([tm(1, 1), tm(1, 1)], [0, 0], "non-negative weights"),
        ([tm(1, 1), tm(1, 1)], [1], "non-negative weights"),
    ],
)
def test_inconsistent_inputs_are_refused(maps, weights, message) -> None:
    with pytest.raises(AggregationError, match=message):
        weighted_mean(maps, weights)


def test_shape_mismatch_is_refused() -> None:
    other = TensorMap(
        {"bn.running_mean": np.zeros(4, np.float32), "bn.num_batches_tracked": np.array(1)}
    )
    with pytest.raises(AggregationError, match="different shapes"):
        weighted_mean([tm(1, 1), other])
