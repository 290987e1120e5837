"""Shared fixtures for the model tests: one CPU thread, seeded torch."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_seeded() -> Iterator[None]:
    # Other engineers share the two cores: one intra-op thread keeps runs predictable.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(previous)
