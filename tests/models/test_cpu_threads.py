"""One thread setting bounds torch's pool and NumPy's BLAS pool."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from threadpoolctl import threadpool_info, threadpool_limits

from models.cpu_threads import limit_cpu_threads


def _blas_threads() -> list[int]:
    np.linalg.svd(np.eye(2))  # NumPy's BLAS is loaded by now (it is, with numpy)
    return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]


def test_both_pools_take_the_count() -> None:
    with threadpool_limits(limits=None):  # gives the process its BLAS pools back afterwards
        for threads in (1, 2):
            limit_cpu_threads(threads)
            assert torch.get_num_threads() == threads
            pools = _blas_threads()
            assert pools, "NumPy's BLAS was not found"
            assert set(pools) == {threads}


def test_a_count_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="threads must be >= 1"):
        limit_cpu_threads(0)
