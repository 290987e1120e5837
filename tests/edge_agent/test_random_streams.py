"""Every random stream an edge algorithm draws from across rounds is checkpointed: a restarted
device continues it (``EdgeAlgorithm.random_streams``), so a resumed run is the run that never
stopped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import edge_agent.algorithms  # noqa: F401 - registers every edge half
from edge_agent.algorithms.base import EDGE_ALGORITHMS, RNG_PREFIX
from protocol.transport.base import MemoryBroker
from tests.helpers_runtime import memory_agent


@pytest.mark.parametrize("name", sorted(EDGE_ALGORITHMS))
def test_every_generator_an_algorithm_holds_is_a_checkpointed_stream(
    name: str, tmp_path: Path
) -> None:
    algorithm = memory_agent(tmp_path, MemoryBroker(), name).algorithm
    held = [v for v in vars(algorithm).values() if isinstance(v, torch.Generator)]
    streams = algorithm.random_streams()
    assert all(any(g is s for s in streams.values()) for g in held)
    saved = algorithm.checkpoint_state()
    assert {k.removeprefix(RNG_PREFIX) for k in saved if k.startswith(RNG_PREFIX)} == set(streams)


def test_a_restored_stream_draws_what_the_saved_one_would_have(tmp_path: Path) -> None:
    algorithm = memory_agent(tmp_path / "a", MemoryBroker(), "fedgen").algorithm
    for g in algorithm.random_streams().values():
        torch.rand(3, generator=g)  # a round's draws
    saved = algorithm.checkpoint_state()
    ahead = [torch.rand(4, generator=g) for g in algorithm.random_streams().values()]
    restored = memory_agent(tmp_path / "b", MemoryBroker(), "fedgen").algorithm
    restored.restore_state(saved)
    again = [torch.rand(4, generator=g) for g in restored.random_streams().values()]
    assert len(again) == 2 and all(torch.equal(a, b) for a, b in zip(ahead, again, strict=True))
