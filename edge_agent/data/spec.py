"""The partition a run uses, as one recordable value, and its command-line spelling.

``--partition dirichlet:0.5``, ``--partition pathological:2`` and ``--partition iid`` map to
:class:`PartitionSpec` fields through :func:`parse_partition`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from edge_agent.data.partition import SCHEME_NAMES, Scheme
from protocol.contract.wire import from_plain
from protocol.errors import ConfigError, ValidationError

__all__ = ["PartitionFields", "PartitionSpec", "make_partition_spec", "parse_partition"]


@dataclass(frozen=True)
class PartitionSpec:
    """Everything that determines a federated split of one dataset.

    Attributes:
        scheme: ``"iid"``, ``"dirichlet"`` or ``"pathological"``.
        alpha: Dirichlet concentration (smaller = stronger label skew).
        classes_per_client: Classes per client for ``"pathological"``.
        num_clients: Number of clients the data is split across.
        seed: Seed of every random choice of the split.
        min_size: Fewest samples (train + test) any client may hold.
        test_fraction: Share of each client's samples kept as its local test set.
        global_test_size: Samples held out first, stratified, as the global test set.
    """

    scheme: Scheme = "iid"
    alpha: float = 0.5
    classes_per_client: int = 2
    num_clients: int = 10
    seed: int = 0
    min_size: int = 10
    test_fraction: float = 0.2
    global_test_size: int = 0

    def __post_init__(self) -> None:
        _checked("scheme", self.scheme, Scheme, f"one of {', '.join(SCHEME_NAMES)}")
        for name, low in (
            ("classes_per_client", 1),
            ("num_clients", 1),
            ("seed", 0),
            ("min_size", 0),
            ("global_test_size", 0),
        ):
            _checked(name, getattr(self, name), int, f"an int >= {low}", low.__le__)  # low <= v
        alpha = _checked("alpha", self.alpha, float, "a number")
        if not alpha > 0:
            raise ConfigError(f"partition.alpha: expected a finite number > 0, got {alpha!r}")
        fraction = _checked("test_fraction", self.test_fraction, float, "a number")
        if not 0.0 <= fraction < 1.0:
            raise ConfigError(
                f"partition.test_fraction: expected a number in [0, 1), got {fraction!r}"
            )
        # stored as floats so that to_dict() is the same whether 1 or 1.0 was given
        object.__setattr__(self, "alpha", alpha)
        object.__setattr__(self, "test_fraction", fraction)

    def to_dict(self) -> dict[str, Any]:
        """The spec as a JSON-serialisable dict (the inverse of :meth:`from_dict`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PartitionSpec:
        """Rebuild a spec; missing keys take their defaults, unknown keys are an error.

        Raises:
            ConfigError: Unknown keys or invalid values.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"partition: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**dict(data))


def _checked(
    name: str, value: object, tp: Any, expected: str, ok: Callable[[Any], bool] = lambda _v: True
) -> Any:
    """``value`` as type ``tp`` (:func:`protocol.contract.wire.from_plain`: no bool for an int,
    finite
    floats) where ``ok`` holds for it, else a :class:`ConfigError` saying ``expected``."""
    try:
        typed = from_plain(tp, value, f"partition.{name}")
        if ok(typed):
            return typed
    except ValidationError:
        pass
    raise ConfigError(f"partition.{name}: expected {expected}, got {value!r}")


class PartitionFields(TypedDict, total=False):
    """The :class:`PartitionSpec` fields a ``--partition`` string sets."""

    scheme: Scheme
    alpha: float
    classes_per_client: int


def _parse_iid(arg: str | None) -> PartitionFields:
    if arg is not None:
        raise ConfigError(f"--partition iid takes no parameter, got 'iid:{arg}'")
    return {"scheme": "iid"}


def _parse_dirichlet(arg: str | None) -> PartitionFields:
    if arg is None:
        return {"scheme": "dirichlet"}
    try:
        alpha = float(arg)
    except ValueError:
        alpha = math.nan
    if not (math.isfinite(alpha) and alpha > 0):
        raise ConfigError(f"--partition dirichlet:ALPHA needs a number > 0, got {arg!r}")
    return {"scheme": "dirichlet", "alpha": alpha}


def _parse_pathological(arg: str | None) -> PartitionFields:
    if arg is None:
        return {"scheme": "pathological"}
    if not arg.isdigit() or int(arg) < 1:
        raise ConfigError(f"--partition pathological:K needs an integer K >= 1, got {arg!r}")
    return {"scheme": "pathological", "classes_per_client": int(arg)}


_PARSERS: dict[str, Callable[[str | None], PartitionFields]] = {
    "iid": _parse_iid,
    "dirichlet": _parse_dirichlet,
    "pathological": _parse_pathological,
}


def parse_partition(text: str) -> PartitionFields:
    """Parse ``"iid"``, ``"dirichlet[:ALPHA]"`` or ``"pathological[:K]"``.

    Returns:
        The fields the string sets, to pass on to :class:`PartitionSpec`.

    Raises:
        ConfigError: Unknown scheme or malformed parameter.
    """
    name, sep, arg = text.strip().partition(":")
    parser = _PARSERS.get(name.lower())
    if parser is None:
        close = difflib.get_close_matches(name.lower(), list(_PARSERS), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(
            f"unknown partition {text!r}{hint}; use iid, dirichlet:ALPHA or pathological:K"
        )
    return parser(arg.strip() if sep else None)


def make_partition_spec(
    partition: str,
    *,
    num_clients: int,
    seed: int = 0,
    min_size: int = 10,
    test_fraction: float = 0.2,
    global_test_size: int = 0,
) -> PartitionSpec:
    """The spec for ``--partition TEXT --clients N --seed S`` (plus the optional knobs)."""
    fields = parse_partition(partition)
    return PartitionSpec(
        num_clients=num_clients,
        seed=seed,
        min_size=min_size,
        test_fraction=test_fraction,
        global_test_size=global_test_size,
        **fields,
    )
