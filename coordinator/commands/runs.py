"""``coordinator status``, ``runs`` and ``stop``: the runs of a state directory."""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.commands.options import Subparsers
    from coordinator.ops.lifecycle import RunInfo

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> None:
    status = sub.add_parser("status", help="a run's state, round and agents (default: latest)")
    _add_state_options(status)
    runs = sub.add_parser("runs", help="the runs in a state directory with their outcome")
    _add_state_options(runs)
    stop = sub.add_parser("stop", help="stop the running coordinator(s) cleanly (resumable)")
    _add_state_options(stop)
    stop.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the exit")


def _add_state_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--state-dir", type=Path, default=Path("runs"), help="directory of run directories"
    )
    p.add_argument("--run-dir", type=Path, default=None, help="one run (default: the latest)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    return {"status": _status, "runs": _runs, "stop": _stop}[args.command](args)


def _selected_runs(args: argparse.Namespace) -> list[RunInfo]:
    from coordinator.ops.lifecycle import list_runs, read_run
    from protocol.errors import ConfigError

    if args.run_dir is None:
        return list_runs(args.state_dir)
    info = read_run(args.run_dir)
    if info is None:
        raise ConfigError(f"{args.run_dir} holds no coordinator run (no state.sqlite)")
    return [info]


def _ago(ts: float) -> str:
    secs = max(0.0, time.time() - ts)
    return f"{secs:.0f} s ago" if secs < 120 else f"{secs / 60:.0f} min ago"


def _status(args: argparse.Namespace) -> int:
    import json

    runs = _selected_runs(args)
    if not runs:
        print(f"no runs in {args.state_dir}")
        return 0
    run = max(runs, key=lambda r: (r.outcome == "running", r.started or 0.0))
    if args.json:
        print(json.dumps(run.to_json(), indent=2))
        return 0
    c = run.config
    print(
        f"run {c.get('run_id')} ({run.run_dir}): {run.outcome}"
        + (f", pid {run.pid}" if run.pid else "")
        + f"\nfederation {c.get('federation')}, algorithm {c.get('algorithm')}, "
        f"round {run.round} of {c.get('rounds')} done ({run.steps_done} steps)"
        + (f"; latest step: {run.step}" if run.step else "")
    )
    for a in run.agents:
        state = "online" if a.online else "offline"
        spent = "" if a.dp_epsilon is None else f", privacy spent epsilon {a.dp_epsilon:.3g}"
        spent += ", budget spent: deselected" if a.budget_spent else ""
        print(f"  {a.device_id:<20} {a.arch:<14} {state:<8} last seen {_ago(a.last_seen)}{spent}")
    return 0


def _runs(args: argparse.Namespace) -> int:
    import json

    runs = _selected_runs(args)
    if args.json:
        print(json.dumps([r.to_json() for r in runs], indent=2))
        return 0
    print("| run | federation | algorithm | outcome | round | agents |\n|---|---|---|---|---|---|")
    for r in runs:
        c = r.config
        print(
            f"| {r.run_dir} | {c.get('federation')} | {c.get('algorithm')} | {r.outcome} "
            f"| {r.round}/{c.get('rounds')} | {len(r.agents)} |"
        )
    return 0


def _stop(args: argparse.Namespace) -> int:
    """SIGTERM to each running coordinator (it saves, says offline, exits), then wait."""
    import json
    import os

    from coordinator.store.lock import lock_holder

    running = [r for r in _selected_runs(args) if r.pid and r.pid > 0]
    for r in running:
        os.kill(r.pid or 0, signal.SIGTERM)
    end = time.monotonic() + args.timeout
    while any(lock_holder(r.run_dir) for r in running) and time.monotonic() < end:
        time.sleep(0.2)
    left = [r for r in running if lock_holder(r.run_dir)]
    if args.json:
        stopped = [str(r.run_dir) for r in running if r not in left]
        print(json.dumps({"stopped": stopped, "still_running": [str(r.run_dir) for r in left]}))
    else:
        for r in running:
            print(f"{r.run_dir}: {'still running' if r in left else 'stopped'} (pid {r.pid})")
        if not running:
            print("no coordinator is running")
    return 1 if left else 0
