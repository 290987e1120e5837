"""Many agents in one process (the in-process simulation, a Ray actor): a split computed once,
and idle agents that do not wake for nothing."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coordinator.sim.simulate import agent_options
from edge_agent import factory
from edge_agent.agent import IDLE_WAIT_S
from edge_agent.factory import SplitCache, build_agent
from edge_agent.knowledge_cache import Waiting
from protocol.transport.base import MemoryBroker, MemoryTransport
from tests.helpers_runtime import FLEET, run_config


def build(tmp_path: Path, index: int, splits: SplitCache | None) -> Any:
    opts = replace(
        agent_options(run_config(tmp_path), FLEET, index), state_dir=tmp_path / str(index)
    )
    return build_agent(opts, MemoryTransport(MemoryBroker(), opts.device_id), splits=splits)


def shard(agent: Any) -> Any:
    return agent.algorithm.ctx.train.y


def test_agents_sharing_a_split_cache_compute_the_split_once_and_get_the_same_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: count the splits computed
    calls: list[object] = []
    make = factory.make_federated_split

    def counted(dataset: Any, spec: Any) -> Any:
        calls.append(spec)
        return make(dataset, spec)

    monkeypatch.setattr(factory, "make_federated_split", counted)
    splits = SplitCache()

    # Execute: three agents with the cache, two without
    cached = [build(tmp_path / "cached", i, splits) for i in range(3)]
    alone = [build(tmp_path / "alone", i, None) for i in range(2)]

    # Assert: one split for the three, one each without; the same shards either way
    assert len(calls) == 1 + 2
    for with_cache, without in zip(cached, alone, strict=False):
        assert np.array_equal(shard(with_cache), shard(without))
    assert not np.array_equal(shard(cached[0]), shard(cached[1]))  # each its own part


def test_an_idle_agent_waits_a_second_or_until_its_next_fetch(tmp_path: Path) -> None:
    agent = build(tmp_path, 0, None)
    assert agent._idle_wait() == IDLE_WAIT_S == 1.0
    task: Any = object()
    soon = time.monotonic() + 0.3
    agent._waiting["t"] = Waiting(task, give_up_at=time.monotonic() + 60, tries=1, next_at=soon)
    assert 0.0 < agent._idle_wait() <= 0.3
    agent._waiting["t"].give_up_at = time.monotonic() - 1  # overdue: no wait at all
    assert agent._idle_wait() == 0.0


def test_agents_sharing_a_split_cache_evaluate_on_one_copy_of_the_global_test_set(
    tmp_path: Path,
) -> None:
    splits = SplitCache()
    first, second = (build(tmp_path / "cached", i, splits) for i in range(2))
    alone = build(tmp_path / "alone", 0, None)

    def held(agent: Any) -> Any:
        return agent.algorithm.ctx.global_test.x

    assert held(first).data_ptr() == held(second).data_ptr()  # one copy for the process
    assert held(alone).data_ptr() != held(first).data_ptr()
    assert torch.equal(held(alone), held(first))  # the same images either way
