"""Server halves of the algorithms, registered by name (importing this registers them all)."""

from coordinator.strategies import ccvr as _ccvr  # noqa: F401
from coordinator.strategies import fd as _fd  # noqa: F401
from coordinator.strategies import fedavg as _fedavg  # noqa: F401
from coordinator.strategies import fedgh as _fedgh  # noqa: F401
from coordinator.strategies import fedkd as _fedkd  # noqa: F401
from coordinator.strategies import fedproto as _fedproto  # noqa: F401
from coordinator.strategies import fedtype as _fedtype  # noqa: F401
from coordinator.strategies import fedvtc as _fedvtc  # noqa: F401
from coordinator.strategies import fml as _fml  # noqa: F401
from coordinator.strategies import lg_fedavg as _lg_fedavg  # noqa: F401
from coordinator.strategies import local as _local  # noqa: F401
from coordinator.strategies.base import (
    STRATEGIES,
    AgentInfo,
    Aggregator,
    PhaseHooks,
    ServerContext,
    Step,
    Strategy,
    check_mode,
    create_strategy,
    register_strategy,
)
from coordinator.strategies.fedgen import strategy as _fedgen  # noqa: F401
from coordinator.strategies.fedktl import strategy as _fedktl  # noqa: F401
from coordinator.strategies.fedtgp import strategy as _fedtgp  # noqa: F401
from coordinator.strategies.felo import strategy as _felo  # noqa: F401

__all__ = [
    "STRATEGIES",
    "AgentInfo",
    "Aggregator",
    "PhaseHooks",
    "ServerContext",
    "Step",
    "Strategy",
    "check_mode",
    "create_strategy",
    "register_strategy",
]
