"""One setting for a process's CPU threads: torch's intra-op pool and the BLAS pool NumPy uses.

``torch.set_num_threads`` sizes torch's pool only. NumPy's linear algebra runs on its own
OpenBLAS, whose pool keeps one thread a core; the low-rank compression of FedKD's uploads
(:mod:`protocol.contract.lowrank`, linear algebra in NumPy) runs there. When several threads call
into that pool at once (simulated agents are threads of one process), OpenBLAS's threads
contend: four concurrent SVDs of a 512 x 4608 layer took 14.4 s on two cores with its default
pool and 1.7 s with one thread; several agent processes on one machine each start a pool of
one thread a core. So a thread count given to an agent or a simulation bounds both pools,
through threadpoolctl (which finds the BLAS library NumPy actually loaded, whatever its
vendor), and a process running several agents without a count gives BLAS one thread.
"""

from __future__ import annotations

from threadpoolctl import threadpool_limits

__all__ = ["apply_thread_setting", "limit_cpu_threads"]


def limit_cpu_threads(threads: int) -> None:
    """Give torch's intra-op pool and the process's BLAS pools ``threads`` threads each, for
    the rest of the process (``threads >= 1``)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)
    threadpool_limits(limits=threads, user_api="blas")


def apply_thread_setting(threads: int, *, agents: int) -> None:
    """A ``--threads`` option of a process that runs ``agents`` agents (as threads): a count
    bounds both pools; 0 keeps the libraries' defaults, except that BLAS gets one thread when
    several agents share the process (their concurrent calls would contend for its pool)."""
    if threads < 0:
        raise ValueError(f"threads must be >= 0, got {threads}")
    if threads:
        limit_cpu_threads(threads)
    elif agents > 1:
        threadpool_limits(limits=1, user_api="blas")
