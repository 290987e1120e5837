"""The engine's dispatch: one handler per message type that agents may send the coordinator."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from protocol.contract.codec import Envelope
from protocol.contract.wire import WireModel

M = TypeVar("M", bound=WireModel)
Handler = Callable[[Envelope, Any], None]  # (envelope, its body)

__all__ = ["Handler", "MessageTable"]


class MessageTable:
    """Handlers keyed by message type; a message of a type without one is refused."""

    def __init__(self) -> None:
        self._handlers: dict[type[WireModel], Handler] = {}

    def on(self, kind: type[M], handler: Callable[[Envelope, M], None]) -> MessageTable:
        """Send every message whose body is a ``kind`` to ``handler``."""
        if kind in self._handlers:
            raise ValueError(f"{kind.KIND} messages already have a handler")
        self._handlers[kind] = handler
        return self

    def handler(self, body: WireModel) -> Handler | None:
        """The handler of ``body``'s type (``None``: no handler)."""
        return self._handlers.get(type(body))
