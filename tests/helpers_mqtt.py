"""Devices and a forger speaking the real protocol over a real broker (importable as
``helpers_mqtt`` under pytest): the security tests' cast.

:class:`ScriptedAgent` registers as a FedProto device and answers each task with what its
script returns, on a thread of its own (a script may wait for a forger). :class:`Forger` is
an anonymous client of the default deployment: it sees every device's tasks and acks and
publishes raw frames in any device's name.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
from helpers import unique_id

from protocol.contract.codec import Envelope, decode, encode
from protocol.contract.messages import (
    Ack,
    Capabilities,
    CoordinatorState,
    InputSpec,
    Message,
    Register,
    Reply,
    Task,
)
from protocol.contract.payloads import PrototypeSet
from protocol.contract.topics import Topics
from protocol.errors import ProtocolError
from protocol.transport.endpoint import Endpoint
from protocol.transport.paho import MqttTransport

__all__ = ["Forger", "ScriptedAgent", "fedproto_register", "proto_reply", "prototypes"]


def prototypes(dim: int, scale: float = 1.0) -> PrototypeSet:
    """Prototypes of classes 0 and 1 (what a FedProto device holding them uploads)."""
    vectors = np.random.default_rng(dim).standard_normal((2, dim)).astype(np.float32) * scale
    return PrototypeSet(np.array([0, 1]), vectors, np.array([5, 5]))


def proto_reply(task: Task, protos: PrototypeSet | None = None, **changes: object) -> Reply:
    """``task``'s reply: ``protos`` in a training round, nothing in ``final``."""
    payloads = {"protos": protos} if protos is not None and task.phase == "train" else {}
    fields: dict[str, object] = {
        "task_id": task.task_id,
        "round": task.round,
        "phase": task.phase,
        "num_samples": 10,
        "payloads": payloads,
    }
    fields.update(changes)
    return Reply(**fields)  # type: ignore[arg-type]


def fedproto_register(device_id: str, feature_dim: int = 0) -> Register:
    """A FedProto device's registration: 10 classes, 5 samples each of classes 0 and 1."""
    return Register(
        device_id=device_id,
        arch="mlp_s",
        num_params=100,
        capabilities=Capabilities(device="cpu"),
        input_spec=InputSpec(1, 8, 8),
        num_classes=10,
        class_counts={"0": 5, "1": 5},
        algorithm="fedproto",
        feature_dim=feature_dim,
    )


class ScriptedAgent:
    """A device speaking the real protocol over MQTT, with a scripted answer to each task.

    ``answer`` runs on a thread per task (it may block, e.g. until a forger is done);
    ``as_id`` publishes as another device (a forger holding no broker identity).
    """

    def __init__(
        self,
        port: int,
        federation: str,
        device_id: str,
        answer: Callable[[Task], Reply | None],
        *,
        as_id: str = "",
        feature_dim: int = 0,
    ) -> None:
        self.device_id, self.answer, self.feature_dim = device_id, answer, feature_dim
        self.topics = Topics(federation)
        sender = as_id or device_id
        self.transport = MqttTransport(client_id=unique_id(sender), port=port)
        self.endpoint = Endpoint(self.transport, sender=sender, federation=federation)
        self.acks: list[Ack] = []
        self.sent: list[str] = []  # msg ids of the replies sent
        self.acked = threading.Event()
        self.registers = False
        self._runs: set[str] = set()  # the runs registered with, once each
        self.endpoint.subscribe(f"{self.topics.base}/dev/{device_id}/down/#", self._on_message)
        # as a real agent: register when a coordinator announces its run (its retained state
        # is published once its subscriptions are in place; a register sent before them would
        # be lost at the broker)
        self.endpoint.subscribe(self.topics.coord_state, self._on_message)

    def start(self, register: bool = True) -> ScriptedAgent:
        self.registers = register
        self.transport.connect()
        return self

    def _on_message(self, env: Envelope, topic: str) -> None:
        body = env.body
        if isinstance(body, CoordinatorState):
            live = body.state in ("starting", "running") and body.run_id not in self._runs
            if live and self.registers:
                self._runs.add(body.run_id)
                reg = fedproto_register(self.device_id, self.feature_dim)
                self.endpoint.send(self.topics.up(self.device_id, "register"), reg)
        elif isinstance(body, Task):
            threading.Thread(target=self._reply, args=(body,), daemon=True).start()
        elif isinstance(body, Ack) and body.ref_id in self.sent:
            self.acks.append(body)
            self.acked.set()

    def _reply(self, task: Task) -> None:
        reply = self.answer(task)
        if reply is not None:
            env = self.endpoint.envelope(reply, round=task.round)
            self.sent.append(env.msg_id)  # before it leaves: its ack may come at once
            self.endpoint.send_envelope(self.topics.up(self.device_id, "reply"), env)

    def close(self) -> None:
        self.endpoint.close()
        self.transport.close()


class Forger:
    """An anonymous client of the default deployment: reads every device's tasks and acks,
    publishes raw frames as anyone. ``on_task(forger, device, task)`` runs on a thread of its
    own for each task it sees."""

    def __init__(
        self,
        port: int,
        federation: str,
        on_task: Callable[[Forger, str, Task], None] | None = None,
    ) -> None:
        self.topics = Topics(federation)
        self.federation = federation
        self.on_task = on_task
        self.transport = MqttTransport(client_id=unique_id("forger"), port=port)
        self.acks: dict[str, Ack] = {}  # ref_id -> the coordinator's ack
        self.tasks: list[tuple[str, Task]] = []  # (device, task) of every task seen
        self._acked = threading.Condition()
        self.transport.subscribe(f"{self.topics.base}/dev/+/down/#", self._on_bytes)

    def start(self) -> Forger:
        self.transport.connect()
        return self

    def _on_bytes(self, topic: str, data: bytes) -> None:
        try:
            env = decode(data)
        except ProtocolError:
            return
        device = self.topics.device_from(topic) or ""
        if isinstance(env.body, Ack):
            with self._acked:
                self.acks[env.body.ref_id] = env.body
                self._acked.notify_all()
        elif isinstance(env.body, Task):
            self.tasks.append((device, env.body))
        if isinstance(env.body, Task) and self.on_task is not None:
            args = (self, device, env.body)
            threading.Thread(target=self.on_task, args=args, daemon=True).start()

    def send(self, device: str, kind: str, body: Message, round: int = 0) -> str:
        """Publish ``body`` on ``device``'s ``up/{kind}`` topic in its name; its message id."""
        env = Envelope(body=body, sender=device, federation=self.federation, round=round)
        self.transport.publish(self.topics.up(device, kind), encode(env))
        return env.msg_id

    def publish(self, topic: str, data: bytes) -> None:
        """Raw bytes on any topic."""
        self.transport.publish(topic, data)

    def wait_ack(self, msg_id: str, timeout: float = 60.0) -> Ack | None:
        """The coordinator's ack of ``msg_id`` (``None``: none within ``timeout``)."""
        with self._acked:
            self._acked.wait_for(lambda: msg_id in self.acks, timeout)
            return self.acks.get(msg_id)

    def close(self) -> None:
        self.transport.close()
