"""One process-wide guard between running models and tracing them for export.

torch's exporters trace a model by patching ``torch.nn.Module.__call__`` for the whole process
(``torch.fx``'s patcher, torch.export's tracing state). A forward pass in another thread while
a trace is open goes through the tracer and corrupts it ("Unexpected key head, expected
head.head"), and two traces at once corrupt each other. One agent per process never meets this;
a simulated fleet (agents as threads of one process) does, at the final phase, when every agent
evaluates and exports at once.

So model work takes the guard's shared side (many threads at once) and a trace its exclusive
side (alone, after the running work has finished; new work waits while a trace is waiting).
The exclusive side is re-entrant for its thread: an agent holds it around its whole export,
and the exporter it calls takes it again.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["TRACE_GUARD", "TraceGuard"]


class TraceGuard:
    """A readers-writer lock: ``running()`` shared, ``tracing()`` exclusive and re-entrant,
    a waiting trace admitted before new running work (traces are rare and short)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._tracer: int | None = None  # thread id of the trace in progress
        self._depth = 0
        self._waiting_traces = 0

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Model work (training, evaluation) that must not overlap a trace in another thread."""
        me = threading.get_ident()
        with self._cond:
            if self._tracer == me:  # inside this thread's own trace: nothing to wait for
                self._running += 1
            else:
                self._cond.wait_for(lambda: self._tracer is None and not self._waiting_traces)
                self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """A trace (an export): alone in the process."""
        me = threading.get_ident()
        with self._cond:
            if self._tracer != me:
                self._waiting_traces += 1
                try:
                    self._cond.wait_for(lambda: self._tracer is None and not self._running)
                finally:
                    self._waiting_traces -= 1
                self._tracer = me
            self._depth += 1
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if not self._depth:
                    self._tracer = None
                self._cond.notify_all()


TRACE_GUARD = TraceGuard()
