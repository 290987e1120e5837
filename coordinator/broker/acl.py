"""The fleet's topic ACL, read from the Mosquitto ``acl`` file that ``coordinator provision``
writes, so that the embedded broker enforces exactly the rules an external Mosquitto does.

Only the subset that file uses is understood (anything else is a :class:`ConfigError`, never
silently ignored): comments, ``pattern read|write|readwrite FILTER`` (``%u`` = the client's
username, which is its certificate's CN), ``user NAME`` and ``topic read|write|readwrite
FILTER`` after it. Semantics are Mosquitto's: *write* allows publishing to a topic the filter
matches; *read* allows subscribing to a filter the rule's filter covers (a device may not widen
``dev/+/down/#``) and receiving messages on matching topics. Everything else is denied.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from protocol.contract.topics import matches
from protocol.errors import ConfigError

__all__ = ["Acl", "AclRule", "covers"]

Access = Literal["read", "write"]
_ACCESS: dict[str, frozenset[str]] = {
    "read": frozenset({"read"}),
    "write": frozenset({"write"}),
    "readwrite": frozenset({"read", "write"}),
}


def covers(allowed: str, requested: str) -> bool:
    """Whether every topic ``requested`` (a filter, maybe with wildcards) can match also matches
    ``allowed``: a wildcard in ``requested`` is covered only by the same or a wider one."""
    want, got = allowed.split("/"), requested.split("/")
    for i, level in enumerate(want):
        if level == "#":
            return True
        if i >= len(got) or got[i] == "#":
            return False
        if level != "+" and (got[i] == "+" or level != got[i]):
            return False
    return len(want) == len(got)


@dataclass(frozen=True, slots=True)
class AclRule:
    """One grant: ``user`` None for a ``pattern`` rule (every user, ``%u`` substituted)."""

    access: frozenset[str]
    topic_filter: str
    user: str | None = None

    def grants(self, user: str, access: Access) -> str | None:
        """The concrete filter this rule grants ``user`` for ``access``, or None."""
        if access not in self.access or (self.user is not None and self.user != user):
            return None
        if self.user is None:
            if "%c" in self.topic_filter:
                return None  # client-id patterns are not in the provisioned file
            if "%u" in self.topic_filter and ("/" in user or "+" in user or "#" in user):
                return None  # a name that would widen the pattern gets nothing (as Mosquitto)
            return self.topic_filter.replace("%u", user)
        return self.topic_filter


@dataclass(frozen=True, slots=True)
class Acl:
    """Parsed ACL rules; :meth:`allows` is the broker's question."""

    rules: tuple[AclRule, ...] = field(default_factory=tuple)

    @classmethod
    def parse(cls, text: str, source: str = "acl") -> Acl:
        """Parse ACL text; a line outside the understood subset is a :class:`ConfigError`."""
        rules: list[AclRule] = []
        user: str | None = None
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            words = line.split()
            where = f"{source}:{number}"
            if words[0] == "user" and len(words) == 2:
                user = words[1]
            elif words[0] in ("pattern", "topic") and len(words) in (2, 3):
                access = "readwrite" if len(words) == 2 else words[1]
                if access not in _ACCESS:
                    raise ConfigError(
                        f"{where}: access {access!r}: expected read, write or readwrite"
                    )
                if words[0] == "topic" and user is None:
                    raise ConfigError(f"{where}: `topic` before any `user` line")
                owner = None if words[0] == "pattern" else user
                rules.append(AclRule(_ACCESS[access], words[-1], owner))
            else:
                raise ConfigError(
                    f"{where}: {line!r}: expected `pattern|topic [read|write|readwrite] FILTER` "
                    "or `user NAME`"
                )
        return cls(tuple(rules))

    @classmethod
    def read(cls, path: Path) -> Acl:
        """Parse the file at ``path``."""
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"ACL file {path}: {exc.strerror or exc}") from exc
        return cls.parse(text, str(path))

    def allows(self, user: str, access: Access, topic: str, *, is_filter: bool = False) -> bool:
        """Whether ``user`` may ``access`` ``topic``; ``is_filter`` for a subscription's filter,
        which must be covered by a granted filter rather than merely overlap it."""
        check = covers if is_filter else matches
        for rule in self.rules:
            granted = rule.grants(user, access)
            if granted is not None and check(granted, topic):
                return True
        return False
