"""Seeded, thread-exclusive use of torch's global random generator.

Module construction (``nn.init``) draws from torch's *global* generator, so a seeded init means
``torch.manual_seed`` followed by the construction. ``coordinator simulate`` runs many agents as
threads of one process: two agents seeding and building at the same time would interleave
their draws and make "seeded" weights depend on thread timing (seen as run-to-run differences
of the FedVTC reproduction, whose clients must all start from the same generator weights).
:func:`seeded` makes such a block exclusive among threads and restores the global generator
afterwards, so an agent's other random streams (its own ``torch.Generator`` objects) and the
other agents are unaffected.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["derived_seed", "seeded"]

_LOCK = threading.RLock()


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with the global CPU generator seeded to ``seed``; restore it after."""
    with _LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def derived_seed(base: int, key: str) -> int:
    """A seed from ``base`` and a name, the same in every process (unlike ``hash(str)``, which
    Python salts per process): agents that agree on both agree on the seed."""
    return (base + zlib.crc32(key.encode())) % 2**63
