"""One setting for a process's CPU threads: torch's intra-op pool and the BLAS pool NumPy uses.

``torch.set_num_threads`` sizes torch's pool only. NumPy's linear algebra runs on its own
OpenBLAS, whose pool keeps one thread a core; the low-rank compression of FedKD's uploads
(:mod:`protocol.contract.lowrank`, an SVD in NumPy) runs there. When several callers share
that pool at once (simulated agents are threads of one process; several agents on one
machine), OpenBLAS's threads contend: four concurrent 512 x 4608 factorisations took 14.4 s
on two cores with its default pool and 1.7 s with one thread. So a thread count given to an
agent or a simulation bounds both pools, through threadpoolctl (which finds the BLAS library
NumPy actually loaded, whatever its vendor).
"""

from __future__ import annotations

import torch
from threadpoolctl import threadpool_limits

__all__ = ["limit_cpu_threads"]


def limit_cpu_threads(threads: int) -> None:
    """Give torch's intra-op pool and the process's BLAS pools ``threads`` threads each, for
    the rest of the process (``threads >= 1``)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    threadpool_limits(limits=threads, user_api="blas")
