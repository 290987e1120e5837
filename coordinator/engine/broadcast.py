"""Broadcast framing: a step's shared payloads go out once as ``knowledge`` (``WIRE.md`` §5),
and its tasks that differ only in their ids are spliced from one frame template."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from typing import Any

from coordinator.config import RunConfig
from coordinator.engine.replies import task_id
from coordinator.engine.step import OpenStep
from coordinator.strategies import Step
from protocol.contract.codec import FrameTemplate, new_message_id
from protocol.contract.messages import UNKNOWN_KNOWLEDGE, ErrorReply, Fetch, Knowledge, Task
from protocol.contract.payloads import Payload, pack_payloads
from protocol.contract.topics import Topics
from protocol.errors import EdgeFLError, LimitError
from protocol.transport.endpoint import Endpoint

__all__ = ["KnowledgeBroadcast", "build_tasks", "send_tasks", "shared_names"]


class KnowledgeBroadcast:
    """The open step's shared knowledge: split from its tasks, published, sent on ``fetch``."""

    def __init__(
        self,
        cfg: RunConfig,
        endpoint: Endpoint,
        topics: Topics,
        reject: Callable[[str, str], None],
    ) -> None:
        self.cfg = cfg
        self.endpoint = endpoint
        self.topics = topics
        self.reject = reject  # counts and logs a message that is not acted on
        # the open step's knowledge (None: its tasks carry all their payloads), kept to answer
        # a `fetch`; rebuilt by a resumed step (configure is deterministic)
        self.knowledge: Knowledge | None = None
        self._sent = False  # some knowledge went out retained: clear it at the end

    def split(
        self, step: Step, payloads: dict[str, dict[str, Payload]]
    ) -> tuple[dict[str, dict[str, Payload]], dict[str, bytes], Knowledge | None]:
        """Move the payloads the agents' tasks share into the step's knowledge (``WIRE.md`` §5).

        ``payloads``: each participant's map from the strategy's ``configure``. Returns the
        maps left in the tasks, the knowledge digest of each device whose task names it, and
        the knowledge (None: nothing shared).

        Shared means the *same object* under one name in every map that has the name, in two
        maps at least (strategies hand every agent the one object of their global knowledge),
        and at least ``run.broadcast_min_bytes`` encoded. A task takes ``shared`` only if it
        has every shared name: the agent merges the whole knowledge, and the algorithm must
        see exactly the map ``configure`` returned.
        """
        names = shared_names(list(payloads.values())) if self.cfg.broadcast else []
        names = [n for n in names if self._big_enough(payloads, n)]
        if not names:
            return payloads, {}, None
        first = next(p for p in payloads.values() if names[0] in p)
        knowledge = Knowledge.of(step.round, {n: first[n] for n in names})
        out, shared = {}, {}
        for device_id, own in payloads.items():
            if all(n in own for n in names):
                out[device_id] = {k: v for k, v in own.items() if k not in knowledge.payloads}
                shared[device_id] = knowledge.digest
            else:
                out[device_id] = own
        return out, shared, knowledge

    def _big_enough(self, payloads: dict[str, dict[str, Payload]], name: str) -> bool:
        if self.cfg.broadcast_min_bytes == 0:
            return True
        payload = next(p[name] for p in payloads.values() if name in p)
        return len(pack_payloads({name: payload})) >= self.cfg.broadcast_min_bytes

    def open(self, knowledge: Knowledge | None) -> None:
        """The step's knowledge: kept for fetches, and published (before the tasks naming it)."""
        self.knowledge = knowledge
        if knowledge is not None:
            self.publish(knowledge)

    def publish(self, knowledge: Knowledge) -> None:
        """Retained on ``bcast/knowledge`` so that an agent subscribing later gets it too.

        Bulk data is never retained (``WIRE.md`` §2): knowledge too large for one frame goes
        out in chunks to the agents subscribed now, the retained one is cleared (it would name
        an older digest), and the others fetch it.
        """
        topic = self.topics.bcast(Knowledge.KIND)
        self._sent = True
        try:
            self.endpoint.send(topic, knowledge, round=knowledge.round, retain=True)
        except LimitError:
            self.endpoint.transport.publish(topic, b"", qos=1, retain=True)
            self.endpoint.send(topic, knowledge, round=knowledge.round)

    def clear(self) -> None:
        """The run is over: its last knowledge must not stay retained for the next run."""
        if self._sent:
            with contextlib.suppress(EdgeFLError):
                self.endpoint.transport.publish(
                    self.topics.bcast(Knowledge.KIND), b"", qos=1, retain=True
                )

    def answer(self, device: str, fetch: Fetch, task: Task | None) -> None:
        """An agent missed the step's knowledge (joined late, lost its session): send it, if
        ``task``, the open step's task of ``device``, names it."""
        knowledge = self.knowledge
        if knowledge is not None and task is not None and task.shared == fetch.digest:
            topic = self.topics.down(device, Knowledge.KIND)
            self.endpoint.send(topic, knowledge, round=knowledge.round)
            return
        reason = f"no task of {device} in the open step names knowledge {fetch.digest.hex()}"
        self.reject("unknown_knowledge", reason)
        body = ErrorReply(code=UNKNOWN_KNOWLEDGE, reason=reason, ref_id=fetch.digest.hex())
        self.endpoint.send(self.topics.down(device, "error"), body)


def build_tasks(
    open_step: OpenStep,
    *,
    run_id: str,
    algorithm: str,
    deadline: float,
    config: dict[str, Any],
    payloads: dict[str, dict[str, Payload]],
    shared: dict[str, bytes],
) -> dict[str, Task]:
    """The step's task of each device of ``payloads`` (its own payloads), naming the knowledge
    digest ``shared`` gives it. Every task holds the same ``config`` and run id objects, so that
    their encodings are reused and :func:`send_tasks` splices the ones without payloads."""
    rec, step = open_step.rec, open_step.step
    return {
        device_id: Task(
            task_id=task_id(run_id, rec.idx, rec.attempt, device_id),
            run_id=run_id,
            round=step.round,
            phase=step.phase,
            deadline=deadline,
            algorithm=algorithm,
            config=config,
            payloads=own,
            shared=shared.get(device_id, b""),
        )
        for device_id, own in payloads.items()
    }


def send_tasks(
    endpoint: Endpoint, topics: Topics, open_step: OpenStep, tasks: dict[str, Task]
) -> None:
    """Send the step's tasks. Those without payloads of their own are one task but for their
    ids (their shared fields are the same objects): their frames are spliced from one template
    per knowledge digest, ~2 us a task instead of ~35 us to build and encode an envelope,
    byte-identical to what ``endpoint.send`` would send."""
    templates: dict[bytes, FrameTemplate] = {}
    round_ = open_step.step.round
    spliced: list[tuple[str, bytes]] = []  # handed to the transport at once, after the loop
    for device_id, task in tasks.items():
        open_step.sent(device_id, task)
        topic = topics.down(device_id, "task")
        if task.payloads:
            endpoint.send(topic, task, round=round_)
            continue
        template = templates.get(task.shared)
        if template is None:
            env = endpoint.envelope(task, round=round_)
            template = templates[task.shared] = FrameTemplate.of(env, ("task_id",))
        spliced.append((topic, template.fill(new_message_id(), task.task_id)))
    endpoint.send_many_unsigned(spliced, kind=Task.KIND, round=round_)


def shared_names(maps: list[dict[str, Payload]]) -> list[str]:
    """Names whose value is one object in every map that has it, and in two maps at least."""
    first: dict[str, Payload] = {}
    count: Counter[str] = Counter()
    differ: set[str] = set()
    for payloads in maps:
        for name, value in payloads.items():
            if first.setdefault(name, value) is not value:
                differ.add(name)
            count[name] += 1
    return [n for n in first if n not in differ and count[n] >= 2]
