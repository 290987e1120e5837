"""``check_max_abs``: its shortcuts (a sum of squares, then max/min) give the exact verdict,
``max |x| <= bound`` with NaN refused, at the bound's edge too."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.contract.validate import check_max_abs
from protocol.errors import ValidationError

BOUND = 1e4


def refused(arr: np.ndarray, bound: float = BOUND) -> bool:
    try:
        check_max_abs(arr, bound, "x")
    except ValidationError:
        return True
    return False


def exact(arr: np.ndarray, bound: float = BOUND) -> bool:
    """The verdict by definition, in float64: refused iff any |x| > bound or any NaN."""
    wide = arr.astype(np.float64)
    return bool(np.isnan(wide).any() or (np.abs(wide) > bound).any())


EDGE = [
    0.0,
    1.0,
    BOUND,
    -BOUND,
    float(np.nextafter(np.float32(BOUND), np.float32(np.inf))),
    float(np.nextafter(np.float32(BOUND), np.float32(0))),
    BOUND / 2**0.5,  # two of these: a sum of squares at the bound exactly
    np.inf,
    -np.inf,
    np.nan,
    3e38,
]


@pytest.mark.filterwarnings("ignore:overflow encountered in matmul:RuntimeWarning")  # see below
@settings(max_examples=300, deadline=None)
@given(
    dtype=st.sampled_from([np.float16, np.float32, np.float64]),
    values=st.lists(
        st.one_of(st.sampled_from(EDGE), st.floats(-2 * BOUND, 2 * BOUND, width=32)),
        min_size=1,
        max_size=64,
    ),
    scale=st.sampled_from([1e-3, 1.0]),
)
def test_the_verdict_is_the_exact_one(dtype: type, values: list[float], scale: float) -> None:
    with np.errstate(over="ignore", invalid="ignore"):
        arr = (np.array(values, dtype=np.float64) * scale).astype(dtype)
    assert refused(arr) == exact(arr)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_value_a_rounding_step_past_the_bound_is_refused_among_many_small(dtype: type) -> None:
    # the sum of squares of 262,144 values is rounded at each step: the test must not let a
    # value one ulp above the bound through because the rounded sum came out small
    arr = np.full(262_144, 1e-3, dtype=dtype)
    arr[7] = np.nextafter(dtype(BOUND), dtype(np.inf))
    assert refused(arr)
    arr[7] = dtype(BOUND)
    assert not refused(arr)


def test_many_values_each_within_the_bound_pass_though_their_norm_exceeds_it() -> None:
    arr = np.full((8, 512), 0.9 * BOUND, dtype=np.float32)  # ||x|| = 57.6 * BOUND
    assert not refused(arr)
    assert refused(np.array([1.0, np.nan], dtype=np.float32))
    assert not refused(np.array([], dtype=np.float32)) and not refused(np.arange(5))


def test_an_overflowing_sum_of_squares_prints_no_warning() -> None:
    # In a process of its own: pytest undoes the modules' warning filters, which are added
    # at import (during collection, inside pytest's own warnings context)
    code = (
        "import numpy as np\n"
        "from protocol.contract import lean\n"
        "from protocol.contract.validate import check_max_abs\n"
        "big = np.full(4, 3e37, dtype=np.float32)\n"
        "assert not lean._finite(big)\n"
        "try:\n"
        "    check_max_abs(big, 1e4, 'x')\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "ValidationError"
    assert run.stderr == ""
