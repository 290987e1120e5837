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
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

__all__ = ["SHARED_MODEL_SEED", "derived_seed", "head_seed", "seeded", "shapes_key"]

# configs carry no seed for a shared start: every agent derives a module's initial weights from
# this constant, the module's role and its architecture or shapes
SHARED_MODEL_SEED = 0x5EED

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


def shapes_key(shapes: Mapping[str, Sequence[int]]) -> str:
    """A module's tensor names and shapes as one string (``weight:[10, 64];bias:[10]``)."""
    return ";".join(f"{k}:{list(v)}" for k, v in shapes.items())


def head_seed(role: str, shapes: Mapping[str, Sequence[int]]) -> int:
    """The seed of the ``role`` algorithm's shared head of these tensor shapes: the same on
    every agent whatever its extractor, and on a server that builds the head itself."""
    return derived_seed(SHARED_MODEL_SEED, f"{role}-head|{shapes_key(shapes)}")
