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
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TypeVar

import torch

__all__ = ["SHARED_MODEL_SEED", "blank", "derived_seed", "head_seed", "seeded", "shapes_key"]

# configs carry no seed for a shared start: every agent derives a module's initial weights from
# this constant, the module's role and its architecture or shapes
SHARED_MODEL_SEED = 0x5EED

_LOCK = threading.RLock()
_BLANK_SEED = 0xB1A4C  # any constant: what a blank module draws is overwritten


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with the global CPU generator seeded to ``seed``; restore it after."""
    with _LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


_Built = TypeVar("_Built")


def blank(build: Callable[[], _Built]) -> _Built:
    """A module whose weights the caller sets next (loaded, or drawn by ``seeded_init`` from
    a private generator). Building it draws from the global generator all the same (each
    layer's ``reset_parameters``); under :func:`seeded` those draws come from a fixed seed, so
    they neither shift other threads' seeded builds nor depend on them."""
    with seeded(_BLANK_SEED):
        return build()


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
