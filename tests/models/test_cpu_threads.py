"""One thread setting bounds torch's pool and NumPy's BLAS pool."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from threadpoolctl import threadpool_info, threadpool_limits

from models.cpu_threads import apply_thread_setting, limit_cpu_threads


def _blas_threads() -> set[int]:
    np.linalg.svd(np.eye(2))  # NumPy's BLAS is loaded by now (it is, with numpy)
    pools = {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}
    assert pools, "NumPy's BLAS was not found"
    return pools


def test_both_pools_take_the_count() -> None:
    with threadpool_limits(limits=None):  # gives the process its BLAS pools back afterwards
        for threads in (1, 2):
            limit_cpu_threads(threads)
            assert torch.get_num_threads() == threads
            assert _blas_threads() == {threads}


def test_no_count_keeps_the_defaults_for_one_agent() -> None:
    with threadpool_limits(limits=None):
        threadpool_limits(limits=2, user_api="blas")
        apply_thread_setting(0, agents=1)
        assert _blas_threads() == {2}


def test_no_count_gives_blas_one_thread_when_agents_share_the_process() -> None:
    with threadpool_limits(limits=None):
        threadpool_limits(limits=2, user_api="blas")
        torch_threads = torch.get_num_threads()
        apply_thread_setting(0, agents=3)
        assert _blas_threads() == {1}
        assert torch.get_num_threads() == torch_threads


def test_a_count_bounds_both_pools_whatever_the_agents() -> None:
    with threadpool_limits(limits=None):
        apply_thread_setting(2, agents=5)
        assert torch.get_num_threads() == 2
        assert _blas_threads() == {2}


@pytest.mark.parametrize(
    "call", [lambda: limit_cpu_threads(0), lambda: apply_thread_setting(-1, agents=1)]
)
def test_counts_out_of_range_are_refused(call: Callable[[], None]) -> None:
    with pytest.raises(ValueError, match="threads must be"):
        call()
