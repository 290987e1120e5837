"""The MQTT topic layout, in one place (``WIRE.md`` §Topics).

Device ids occupy their own topic level so that a broker ACL with ``%u`` can confine each
device to its own subtree.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from protocol.errors import ValidationError

__all__ = [
    "CHUNKS",
    "COORDINATOR_ID",
    "SHARE",
    "Topics",
    "compile_filter",
    "matches",
    "shared",
    "validate_id",
]

PREFIX = "edgefl/v1"
#: The sender id of every coordinator frame and its certificate CN: agents act on a
#: ``coord_state`` only from this sender (a device's own key verifies its own frames too).
COORDINATOR_ID = "coordinator"
_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: MQTT 5 shared-subscription prefix (also honoured for 3.1.1 clients by Mosquitto 2, EMQX and
#: HiveMQ): ``$share/{group}/{filter}`` delivers each message to one member of the group
SHARE = "$share"
#: The level after a device's message topic on which that message's chunk frames travel
CHUNKS = "chunk"
_CHUNK_SUFFIX = f"/{CHUNKS}"


def validate_id(value: str, field: str = "id") -> str:
    """Ids used as topic levels: 1-64 of ``[A-Za-z0-9_.-]`` (no wildcards, no slashes)."""
    if not isinstance(value, str) or not _ID.match(value):
        raise ValidationError(field, "1-64 characters from [A-Za-z0-9_.-]", value)
    return value


@dataclass(frozen=True, slots=True)
class Topics:
    """Topic names of one federation."""

    federation: str = "default"

    def __post_init__(self) -> None:
        validate_id(self.federation, "federation")

    @property
    def base(self) -> str:
        """``edgefl/v1/{fed}``."""
        return f"{PREFIX}/{self.federation}"

    @property
    def coord_state(self) -> str:
        """Coordinator status, retained, with last will."""
        return f"{self.base}/coord/state"

    @property
    def coord_inbox(self) -> str:
        """Messages addressed to the coordinator itself (chunk requests)."""
        return f"{self.base}/coord/in"

    @property
    def round(self) -> str:
        """Current round descriptor, retained."""
        return f"{self.base}/round"

    def bcast(self, kind: str) -> str:
        """One payload for every agent."""
        return f"{self.base}/bcast/{kind}"

    def down(self, device_id: str, kind: str) -> str:
        """Coordinator -> one agent."""
        return f"{self.base}/dev/{validate_id(device_id, 'device_id')}/down/{kind}"

    def up(self, device_id: str, kind: str) -> str:
        """Agent -> coordinator."""
        return f"{self.base}/dev/{validate_id(device_id, 'device_id')}/up/{kind}"

    def status(self, device_id: str) -> str:
        """Agent birth / last will, retained."""
        return f"{self.base}/dev/{validate_id(device_id, 'device_id')}/status"

    def progress(self, device_id: str) -> str:
        """Training progress and heartbeats, QoS 0."""
        return f"{self.base}/dev/{validate_id(device_id, 'device_id')}/progress"

    def ingest(self, worker: str) -> str:
        """An ingest worker's presence (``online``, will ``offline``), retained; the round
        leader resends the open tasks when one goes (``docs/howto/run-at-scale.md``)."""
        return f"{self.base}/coord/ingest/{validate_id(worker, 'worker')}"

    def chunk_topic(self, topic: str) -> str:
        """Where the chunk frames of a message on ``topic`` travel: a device's up or down
        topic ``dev/{id}/up|down/{kind}`` has its own ``.../{kind}/chunk`` (so a subscriber
        to a message topic, such as the ingest workers' shared ``up/reply``, gets whole
        messages only, and the chunks go to whoever subscribes to the chunk topics: the
        round leader); other topics (``bcast/*``) carry their chunks themselves."""
        return f"{topic}/{CHUNKS}" if self._device_message(topic.split("/")) else topic

    def message_topic(self, topic: str) -> str | None:
        """The message topic of a device's chunk topic (:meth:`chunk_topic`), else ``None``."""
        if not topic.endswith(_CHUNK_SUFFIX):
            return None
        parent = topic[: -len(_CHUNK_SUFFIX)]
        return parent if self._device_message(parent.split("/")) else None

    def _device_message(self, parts: list[str]) -> bool:
        """Whether ``parts`` are the levels of a ``{base}/dev/{id}/up|down/{kind}`` topic."""
        base = self.base.split("/")
        n = len(base)
        return (
            len(parts) == n + 4
            and parts[:n] == base
            and parts[n] == "dev"
            and parts[n + 2] in ("up", "down")
        )

    def device_from(self, topic: str) -> str | None:
        """The device id in a ``dev/{id}/...`` topic, else ``None``."""
        parts = topic.split("/")
        base = self.base.split("/")
        if parts[: len(base)] == base and len(parts) > len(base) + 1 and parts[len(base)] == "dev":
            return parts[len(base) + 1]
        return None


def shared(group: str, topic_filter: str) -> str:
    """``topic_filter`` as a subscription shared by the members of ``group``."""
    return f"{SHARE}/{validate_id(group, 'group')}/{topic_filter}"


def compile_filter(topic_filter: str) -> re.Pattern[str]:
    """A pattern whose ``fullmatch`` tells whether a topic matches ``topic_filter``: ``+`` is
    one level (possibly empty), ``#`` this level and every level below, including none (``a/#``
    matches ``a``); a shared filter matches what its inner filter does (messages arrive on
    their own topic, without the ``$share/{group}/`` prefix)."""
    parts = topic_filter.split("/")
    if parts[0] == SHARE and len(parts) > 2:
        parts = parts[2:]
    out = []
    for i, part in enumerate(parts):
        if part == "#":
            out.append(".*" if i == 0 else "(?:/.*)?")
            break
        out.append(("/" if i else "") + ("[^/]*" if part == "+" else re.escape(part)))
    return re.compile("".join(out), re.DOTALL)


_compiled = functools.lru_cache(maxsize=4096)(compile_filter)


def matches(pattern: str, topic: str) -> bool:
    """MQTT topic-filter matching with ``+`` and ``#`` (:func:`compile_filter`, cached)."""
    return _compiled(pattern).fullmatch(topic) is not None
