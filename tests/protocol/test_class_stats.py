"""The class-statistics payload (CCVR): what it accepts, what it refuses, and its round trip."""

import numpy as np
import pytest

from protocol.contract.payloads import ClassStats
from protocol.errors import ValidationError


def stats(**change: object) -> ClassStats:
    fields: dict[str, object] = {
        "class_ids": np.array([0, 2], np.int32),
        "means": np.zeros((2, 2), np.float32),
        "covariances": np.array([[[2, 1], [1, 3]], [[1, 0], [0, 1]]], np.float32),
        "counts": np.array([4, 9], np.int32),
    }
    fields.update(change)
    return ClassStats(**fields)  # type: ignore[arg-type]


def test_valid_statistics_round_trip_exactly_and_as_float16() -> None:
    for encoding in ("raw", "f16"):
        s = stats(encoding=encoding)
        back = ClassStats.from_wire(s.to_wire(), "stats")
        np.testing.assert_array_equal(back.covariances, s.covariances)  # small ints: exact
        assert back.class_ids.tolist() == [0, 2] and back.counts.tolist() == [4, 9]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"covariances": np.array([[[2, 1], [0, 3]], [[1, 0], [0, 1]]], np.float32)}, "symmetric"),
        ({"covariances": np.array([[[-2, 0], [0, 3]], [[1, 0], [0, 1]]], np.float32)}, "variances"),
        ({"covariances": np.zeros((2, 3, 3), np.float32)}, "covariances"),
        ({"counts": np.array([0, 9], np.int32)}, "at least one sample"),
        ({"means": np.full((2, 2), np.nan, np.float32)}, "means"),
        ({"class_ids": np.array([1, 1], np.int32)}, "unique"),
    ],
)
def test_inconsistent_statistics_are_refused(change: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        stats(**change)
