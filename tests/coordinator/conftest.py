"""Fixtures shared by the coordinator's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread, as in each Ray actor: the same kernels, the same float sums."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
