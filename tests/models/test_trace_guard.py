"""TRACE_GUARD: model work and export traces never overlap across the threads of one process."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from export import export_model
from models import create_model
from models.checkpoint import HeadSpec
from models.trace_guard import TRACE_GUARD, TraceGuard

WAIT = 5.0


def _in_thread(target: object) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)  # type: ignore[arg-type]
    thread.start()
    return thread


def test_a_trace_waits_for_running_work_and_new_work_waits_for_the_trace() -> None:
    guard = TraceGuard()
    release_work, traced, late_work = threading.Event(), threading.Event(), threading.Event()
    order: list[str] = []

    def trace() -> None:
        with guard.tracing():
            order.append("trace")
            traced.set()

    def late() -> None:
        with guard.running():
            order.append("late work")
            late_work.set()

    with guard.running():
        tracer = _in_thread(trace)
        assert not traced.wait(0.2)  # running work holds the trace off
        latecomer = _in_thread(late)
        assert not late_work.wait(0.2)  # and a waiting trace holds new work off
        release_work.set()
    tracer.join(WAIT)
    latecomer.join(WAIT)
    assert order == ["trace", "late work"]


def test_the_tracing_thread_reenters_and_runs_its_own_checks() -> None:
    guard = TraceGuard()
    done = threading.Event()

    def nested() -> None:
        with guard.tracing(), guard.tracing(), guard.running():
            done.set()

    _in_thread(nested).join(WAIT)
    assert done.is_set()
    with guard.running():  # released: other work goes on
        pass


def test_an_export_while_another_thread_runs_a_model_corrupts_neither(tmp_path: Path) -> None:
    # torch's tracer patches nn.Module.__call__ process-wide: without the guard the other
    # thread's forward passes went through it ("Unexpected key ..., expected trunk.2@1")
    model = create_model("cnn_t1", num_classes=10, in_chans=1, input_size=8)
    other = create_model("cnn_t1", num_classes=10, in_chans=1, input_size=8)
    stop, running, errors = threading.Event(), threading.Event(), list[BaseException]()

    def run_other() -> None:
        x = torch.rand(4, 1, 8, 8)
        try:
            while not stop.is_set():
                with TRACE_GUARD.running(), torch.no_grad():
                    other(x)
                running.set()
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    worker = _in_thread(run_other)
    assert running.wait(WAIT)
    try:
        for n in range(2):
            export_model(model, HeadSpec("logits"), tmp_path / f"{n}.onnx", input_shape=(1, 8, 8))
    finally:
        stop.set()
        worker.join(WAIT)
    assert errors == []
