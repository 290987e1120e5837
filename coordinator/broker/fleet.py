"""amqtt's broker with the session rules a provisioned fleet needs, where amqtt's own order of
work breaks them and no plugin is asked in time.

:class:`coordinator.broker.embedded.EmbeddedBroker` runs it on a broker directory of
``coordinator provision``; the plugins (:mod:`coordinator.broker.plugins`) decide, this class
makes amqtt ask them first:

* **Mutual TLS with the CRL**: the listener demands a client certificate of the fleet's CA that
  the CRL does not revoke (amqtt's own context only asks for one).
* **Authentication before the session lookup**: amqtt finds the session of the CONNECT's client
  id (deleting it for a clean session, taking it over for a persistent one, cutting the
  connection that holds it) and only then asks the plugins whether the newcomer may log in.
  A device refused for using another's client id had already cut that device off, which then
  never received another task. Here the plugins judge the newcomer on a session of its own,
  and a refused client never touches the sessions; it is logged in one line (amqtt's close of
  a refused connection logged a traceback when the client had already hung up).
* **Retained messages only to their readers**: at connect amqtt sends a client the retained
  messages matching *every* client's subscriptions, without asking the ACL. Here a client gets
  a retained message only for a filter it subscribed to itself, with a granted subscription,
  and only on a topic its ACL lets it read.

This module imports amqtt: import it only where the embedded broker runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from amqtt.broker import Broker
from amqtt.contexts import Action
from amqtt.errors import AMQTTError, MQTTError, NoDataError
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.session import Session
from amqtt.utils import gen_client_id

from coordinator.broker.plugins import mutual_tls_context

__all__ = ["fleet_broker_class"]

# what a persistent session takes from each new CONNECT of its owner (as amqtt does)
_RENEWED = (
    "will_flag",
    "will_message",
    "will_topic",
    "will_qos",
    "will_retain",
    "keep_alive",
    "username",
    "password",
)


def fleet_broker_class(crlfile: str) -> type[Broker]:
    """amqtt's broker class with the fleet's session rules and a TLS listener checking
    ``crlfile``."""

    class FleetBroker(Broker):  # type: ignore[misc]  # amqtt ships no type information
        """amqtt that authenticates before it looks up a session and filters retained
        messages by subscription and ACL."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._refused: set[int] = set()  # handlers of refused connections, by id

        @staticmethod
        def _create_ssl_context(listener: Any) -> Any:
            ca, cert, key = (str(listener[k]) for k in ("cafile", "certfile", "keyfile"))
            return mutual_tls_context(ca, cert, key, crlfile)

        async def _initialize_client_session(
            self, reader: Any, writer: Any, remote_address: str, remote_port: int
        ) -> tuple[Any, Session]:
            try:
                handler, incoming = await BrokerProtocolHandler.init_from_connect(
                    reader, writer, self.plugins_manager
                )
            except (AMQTTError, MQTTError, NoDataError) as exc:
                await _close(writer)
                raise AMQTTError(
                    f"{remote_address}:{remote_port}: no valid CONNECT ({exc})"
                ) from exc
            if incoming.clean_session and not incoming.client_id:
                incoming.client_id = gen_client_id()
            incoming.ssl_object = writer.get_ssl_info()
            if not await self._authenticate(incoming, None):  # the plugins logged why
                handler.attach(incoming, reader, writer)
                with contextlib.suppress(OSError, MQTTError):
                    await handler.mqtt_connack_authorize(False)
                await _close(writer)
                self._refused.add(id(handler))
                return handler, incoming
            return handler, await self._session_of(incoming, writer)

        async def _session_of(self, incoming: Session, writer: Any) -> Session:
            """The authenticated client's session: amqtt's lookup, after the check."""
            session = incoming
            if incoming.clean_session:
                await self._delete_session(incoming.client_id)
                incoming.parent = 0
            elif incoming.client_id in self._sessions:
                session = self._sessions[incoming.client_id][0]
                for name in _RENEWED:
                    setattr(session, name, getattr(incoming, name))
                session.parent = 1
            else:
                incoming.parent = 0
            # a resumed session keeps the TLS object of the connection that made it: checking
            # that one would let a device log in with the certificate of the session's maker
            session.ssl_object = writer.get_ssl_info()
            delay = self.config.get("timeout-disconnect-delay", 0)
            if session.keep_alive > 0 and isinstance(delay, int):
                session.keep_alive += delay
            return session

        async def _handle_client_session(
            self, reader: Any, writer: Any, session: Session, handler: Any, *rest: Any
        ) -> None:
            if id(handler) in self._refused:
                self._refused.discard(id(handler))
                return  # refused before any session was touched
            try:
                await super()._handle_client_session(reader, writer, session, handler, *rest)
            except ConnectionError as exc:  # the client hung up first: no traceback for that
                self.logger.warning("client %s: connection lost (%s)", session.client_id, exc)

        async def _publish_retained_messages_for_subscription(
            self, subscription: tuple[str, int], session: Session
        ) -> None:
            topic_filter, qos = subscription
            granted = self._subscriptions.get(topic_filter, ())
            handler = self._get_handler(session)
            if handler is None or all(s.client_id != session.client_id for s, _ in granted):
                return  # another client's filter (amqtt offers every filter at connect)
            sends = []
            for topic, retained in list(self._retained_messages.items()):
                if self._matches(topic, topic_filter) and await self._topic_filtering(
                    session, topic, Action.RECEIVE
                ):
                    level = min(qos, retained.qos or qos)
                    sends.append(handler.mqtt_publish(topic, retained.data, level, retain=True))
            if sends:
                await asyncio.gather(*sends, return_exceptions=True)  # as amqtt: a lost one is lost

    return FleetBroker


async def _close(writer: Any) -> None:
    """Close a connection whose client may have hung up already."""
    with contextlib.suppress(OSError):
        await writer.close()
