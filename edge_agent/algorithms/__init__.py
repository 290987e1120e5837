"""Edge halves of the algorithms, registered by name (importing this registers them all)."""

from edge_agent.algorithms import ccvr as _ccvr  # noqa: F401
from edge_agent.algorithms import fd as _fd  # noqa: F401
from edge_agent.algorithms import fedavg as _fedavg  # noqa: F401
from edge_agent.algorithms import fedgen as _fedgen  # noqa: F401
from edge_agent.algorithms import fedgh as _fedgh  # noqa: F401
from edge_agent.algorithms import fedkd as _fedkd  # noqa: F401
from edge_agent.algorithms import fedktl as _fedktl  # noqa: F401
from edge_agent.algorithms import fedproto as _fedproto  # noqa: F401
from edge_agent.algorithms import fedtgp as _fedtgp  # noqa: F401
from edge_agent.algorithms import fedtype as _fedtype  # noqa: F401
from edge_agent.algorithms import fedvtc as _fedvtc  # noqa: F401
from edge_agent.algorithms import felo as _felo  # noqa: F401
from edge_agent.algorithms import fml as _fml  # noqa: F401
from edge_agent.algorithms import lg_fedavg as _lg_fedavg  # noqa: F401
from edge_agent.algorithms import local as _local  # noqa: F401
from edge_agent.algorithms.base import (
    EDGE_ALGORITHMS,
    EdgeAlgorithm,
    EdgeContext,
    PhaseResult,
    create_edge_algorithm,
    register_edge_algorithm,
)

__all__ = [
    "EDGE_ALGORITHMS",
    "EdgeAlgorithm",
    "EdgeContext",
    "PhaseResult",
    "create_edge_algorithm",
    "register_edge_algorithm",
]
