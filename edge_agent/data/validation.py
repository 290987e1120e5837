"""A device's validation split: a seeded, class-stratified share of its training data.

The agent cuts it from its training samples when a task's ``validation_fraction`` asks for one
(``TrainConfig.validation_fraction``). The split never trains and never touches the test data:
it is what the device's best round is chosen by, and what the coordinator may stop on, without
selecting on the test split the run reports. The same labels, fraction and seed give the same
split, so a restarted agent holds out the same samples again.
"""

from __future__ import annotations

import zlib

import numpy as np

from edge_agent.data.partition import IndexArray
from edge_agent.data.split import stratified_take

__all__ = ["validation_indices", "validation_seed"]

_VALIDATION = 4  # the stage tag of the seed sequence (edge_agent/data/split.py has 1 to 3)


def validation_seed(device_id: str) -> int:
    """The seed of ``device_id``'s split: the same in every process and every restart."""
    return zlib.crc32(device_id.encode())


def validation_indices(
    labels: IndexArray, fraction: float, seed: int
) -> tuple[IndexArray, IndexArray]:
    """``(train, validation)``: sorted indices into ``labels`` that partition them, the
    validation part ``fraction`` of the samples with the class proportions kept.

    Every class keeps at least one training sample, so a device holding a class only once
    holds none of it out; a tiny dataset may thus get an empty validation part.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"validation fraction must be in [0, 1), got {fraction!r}")
    pool = np.arange(len(labels), dtype=np.int64)
    n = int(fraction * len(pool) + 0.5)
    rng = np.random.default_rng([seed, _VALIDATION])
    held_out, train = stratified_take(labels, pool, n, rng, keep_one=True)
    return train, held_out
