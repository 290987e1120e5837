"""Typed configs shared by both halves of every algorithm, registered by name."""

from protocol.algorithms import ccvr as _ccvr  # noqa: F401  (registers configs)
from protocol.algorithms import fd as _fd  # noqa: F401
from protocol.algorithms import fedavg as _fedavg  # noqa: F401
from protocol.algorithms import fedgen as _fedgen  # noqa: F401
from protocol.algorithms import fedgh as _fedgh  # noqa: F401
from protocol.algorithms import fedkd as _fedkd  # noqa: F401
from protocol.algorithms import fedktl as _fedktl  # noqa: F401
from protocol.algorithms import fedproto as _fedproto  # noqa: F401
from protocol.algorithms import fedtgp as _fedtgp  # noqa: F401
from protocol.algorithms import fedtype as _fedtype  # noqa: F401
from protocol.algorithms import fedvtc as _fedvtc  # noqa: F401
from protocol.algorithms import felo as _felo  # noqa: F401
from protocol.algorithms import fml as _fml  # noqa: F401
from protocol.algorithms import lg_fedavg as _lg_fedavg  # noqa: F401
from protocol.algorithms import local as _local  # noqa: F401
from protocol.algorithms.base import (
    CONFIG_TYPES,
    DEFAULT_FEATURE_DIM,
    AlgorithmConfig,
    TrainConfig,
    config_type,
    register_config,
)

__all__ = [
    "CONFIG_TYPES",
    "DEFAULT_FEATURE_DIM",
    "AlgorithmConfig",
    "TrainConfig",
    "config_type",
    "register_config",
]
