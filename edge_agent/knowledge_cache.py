"""The agent's side of the broadcast (``WIRE.md`` §5, ``knowledge``): the knowledge it holds,
the tasks waiting for knowledge it lacks, and the merge that gives a task its whole payload map.

A task with ``shared`` set carries only the payloads that are its own; the rest came once for
every agent on ``bcast/knowledge``. The algorithm must see exactly the map the coordinator's
strategy built, so :func:`merge` rebuilds it and refuses a name found on both sides.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from dataclasses import dataclass

from protocol.contract.messages import Knowledge, Task
from protocol.errors import EdgeFLError, ValidationError

__all__ = ["FetchPolicy", "KnowledgeCache", "KnowledgeError", "Waiting", "merge"]


class KnowledgeError(EdgeFLError):
    """A task's knowledge never arrived (or the coordinator does not hold it)."""


@dataclass(frozen=True)
class FetchPolicy:
    """How an agent asks for knowledge it lacks: at once, then after ``first_wait_s``, doubling,
    ``attempts`` fetches in all; it gives up ``margin_s`` before the task's deadline at the
    latest, so that its error still reaches the coordinator inside the step."""

    attempts: int = 5
    first_wait_s: float = 1.0
    margin_s: float = 2.0

    def wait(self, tries: int) -> float:
        """Seconds after the ``tries``-th fetch before the next one (or before giving up)."""
        return self.first_wait_s * 2.0 ** (tries - 1)


class KnowledgeCache:
    """The last ``size`` knowledge messages, by digest (a step needs one; a few cover a task
    of the previous step still waiting, and a retained one of another run)."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._held: OrderedDict[bytes, Knowledge] = OrderedDict()

    def put(self, knowledge: Knowledge) -> None:
        """Hold ``knowledge`` (validated by its decoding: the digest matches the payloads)."""
        self._held[knowledge.digest] = knowledge
        self._held.move_to_end(knowledge.digest)
        while len(self._held) > self.size:
            self._held.popitem(last=False)

    def get(self, digest: bytes) -> Knowledge | None:
        """The knowledge named ``digest``, if held."""
        return self._held.get(digest)

    def __len__(self) -> int:
        return len(self._held)


@dataclass
class Waiting:
    """A task parked until its knowledge arrives.

    ``give_up_at`` and ``next_at`` are monotonic times: the task fails at the first, and the
    next fetch (or, once ``tries`` reached the policy's attempts, the failure) is due at the
    second.
    """

    task: Task
    give_up_at: float
    tries: int = 0
    next_at: float = 0.0

    @classmethod
    def park(cls, task: Task, policy: FetchPolicy) -> Waiting:
        """Park ``task``: its deadline (coordinator's wall clock) less the margin, made
        monotonic so that a clock step on the device cannot stretch or cut the wait."""
        left = task.deadline - policy.margin_s - time.time()
        return cls(task, give_up_at=time.monotonic() + left)


def merge(task: Task, knowledge: Knowledge) -> Task:
    """``task`` with the knowledge's payloads added, as the strategy built it.

    Raises:
        ValidationError: the digest is not the task's, or a payload name is in both maps.
    """
    if knowledge.digest != task.shared:
        raise ValidationError("task.shared", knowledge.digest.hex(), task.shared.hex())
    both = sorted(set(task.payloads) & set(knowledge.payloads))
    if both:
        raise ValidationError(
            "task.payloads", f"names not in knowledge {task.shared.hex()[:16]}", both
        )
    return dataclasses.replace(task, payloads={**knowledge.payloads, **task.payloads}, shared=b"")
