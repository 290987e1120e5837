"""A Jetson-class device profile, measured on this CPU: start-up, idle and peak memory per model.

Each ``edge-agent`` runs in its own cgroup (v1, ``/sys/fs/cgroup/{cpu,memory}``) limited to
``--cpus`` cores (CFS quota) and ``--memory`` bytes, the budget of a small Jetson (Nano: 4
cores, 4 GiB shared with the GPU; a device should leave half of it to its real work). Per model:

1. **start**: launch -> its ``register`` message at a subscriber on a loopback Mosquitto that
   holds a retained ``running`` state, wall time and the agent's own CPU time (utime + stime
   from ``/proc/PID/stat``: less sensitive to other load on the machine than the wall time);
   ``VmRSS`` right after registering (idle, before any training).
2. **round**: ``coordinator serve`` (outside the cgroup) and the same agent on MNIST-5k run one
   FedProto round and the ONNX export, and the agent's peak RSS over its whole life
   (``ru_maxrss`` from ``wait4``) is read when it exits.
3. **imports**: one more launch under ``python -X importtime``: the top-level packages an agent
   has imported when it registers, by cumulative import time.

Writes ``benchmarks/results/device_profile.json`` and prints a markdown table. Needs root (or a
delegated cgroup) for the limits; ``--no-limits`` measures without them and says so.

Usage::

    python benchmarks/bench_device_profile.py --models mlp_s cnn4 hcnn1 resnet8 mobilenet_v2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_agent_start import _agent_cmd, _proc_status, _retain_running_state  # sibling
from bench_ingest import RawMqtt  # sibling benchmark module

FEDERATION = "startbench"  # the federation _retain_running_state announces
CGROUP_ROOT = Path("/sys/fs/cgroup")
DEFAULT_MODELS = ["mlp_s", "cnn_t2", "cnn4", "hcnn1_1024", "resnet8", "mobilenet_v2"]
HEAVY = ("torch", "torchvision", "onnx", "onnxruntime", "sklearn", "numpy", "msgspec", "paho")
GOALS = {"start_s": 1.5, "idle_mib": 600}


class Cgroup:
    """A v1 cpu + memory cgroup that a child joins before it execs."""

    def __init__(self, name: str, cpus: float, memory: int) -> None:
        self.dirs = [CGROUP_ROOT / "cpu" / name, CGROUP_ROOT / "memory" / name]
        for d in self.dirs:
            d.mkdir(exist_ok=True)
        period = int((self.dirs[0] / "cpu.cfs_period_us").read_text())
        (self.dirs[0] / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))
        (self.dirs[1] / "memory.limit_in_bytes").write_text(str(memory))
        self.reset_peak()

    def reset_peak(self) -> None:
        (self.dirs[1] / "memory.max_usage_in_bytes").write_text("0")

    def peak_mib(self) -> int:
        """The group's peak charge (RSS plus page cache) since :meth:`reset_peak`."""
        return int((self.dirs[1] / "memory.max_usage_in_bytes").read_text()) // 2**20

    def failcnt(self) -> int:
        return int((self.dirs[1] / "memory.failcnt").read_text())

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` run by a shell that joins the group and then execs it (same PID; no
        ``preexec_fn``, which is unsafe beside the subscriber's thread)."""
        joins = " && ".join(f"echo $$ > {d / 'cgroup.procs'}" for d in self.dirs)
        return ["sh", "-c", f'{joins} && exec "$@"', "sh", *cmd]

    def remove(self) -> None:
        for d in self.dirs:
            with contextlib.suppress(OSError):
                d.rmdir()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a running process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def agent_args(model: str, port: int, state: Path, data: str, *extra: str) -> list[str]:
    return [
        "--broker",
        f"127.0.0.1:{port}",
        "--id",
        f"dev-{model}".replace("_", "-"),
        "--model",
        model,
        "--data",
        data,
        "--no-signing",
        "--state-dir",
        str(state),
        "--threads",
        "1",
        "--log-level",
        "WARNING",
        *extra,
    ]


def measure_start(
    port: int,
    model: str,
    tmp: Path,
    group: Cgroup | None,
    *,
    importtime: bool = False,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Launch -> registration (wall and CPU), idle RSS; with ``importtime``, the imports."""
    sub = RawMqtt(port, f"profile-sub-{model}-{time.monotonic_ns()}")
    sub.subscribe(f"edgefl/v1/{FEDERATION}/dev/+/up/register", 1)
    done: dict[str, float] = {}

    def wait() -> None:
        sub.consume(lambda _t, _p: bool(done.setdefault("at", time.perf_counter())) and False)

    threading.Thread(target=wait, daemon=True).start()
    cmd = _agent_cmd()
    if importtime:
        cmd = [sys.executable, "-X", "importtime", "-m", "edge_agent.cli"]
    state = tmp / f"start-{model}-{time.monotonic_ns()}"
    args = agent_args(model, port, state, "mnist5k", "--federation", FEDERATION)
    args += ["--algorithm", "fedproto", "--no-export"]
    log = state.with_suffix(".stderr")  # a file: -X importtime would fill a pipe and block
    t0 = time.perf_counter()
    with log.open("wb") as err_file:
        proc = subprocess.Popen(
            limited(group, [*cmd, *args]), stdout=subprocess.DEVNULL, stderr=err_file
        )
    try:
        while "at" not in done and time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                err = log.read_text(errors="replace")[-800:]
                raise RuntimeError(f"{model}: agent exited {proc.returncode}: {err}")
            time.sleep(0.005)
        if "at" not in done:
            raise RuntimeError(f"{model}: no registration within {timeout} s")
        cpu = cpu_seconds(proc.pid)
        mem = _proc_status(proc.pid)
    finally:
        proc.kill()
        proc.wait()
        sub.close()
    row: dict[str, Any] = {
        "start_s": round(done["at"] - t0, 3),
        "start_cpu_s": round(cpu, 3),
        "idle_mib": mem.get("VmRSS"),
    }
    if importtime:
        row["imports"] = top_imports(log.read_text(errors="replace"))
    return row


def top_imports(log: str, top: int = 8) -> list[tuple[str, float]]:
    """Top-level packages by cumulative import time (ms) from ``-X importtime`` output."""
    totals: dict[str, float] = {}
    for line in log.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)$", line)
        if m and len(m.group(2)) <= 1:  # a top-level import (not nested in another)
            pkg = m.group(3).split(".")[0]
            totals[pkg] = totals.get(pkg, 0.0) + int(m.group(1)) / 1000
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return [(name, round(ms, 1)) for name, ms in ranked]


def limited(group: Cgroup | None, cmd: list[str]) -> list[str]:
    return cmd if group is None else group.wrap(cmd)


def measure_round(model: str, tmp: Path, group: Cgroup | None) -> dict[str, Any]:
    """One FedProto round and the export on MNIST-5k; the agent's peak RSS."""
    from coordinator.broker.embedded import MosquittoBroker

    run_dir = tmp / f"run-{model}"
    with MosquittoBroker() as broker:
        serve = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "serve", "--broker",
             f"127.0.0.1:{broker.port}", "--algorithm", "fedproto", "--rounds", "1",
             "--min-agents", "1", "--run-dir", str(run_dir), "--log-level", "WARNING",
             "--set", "run.deadline_s=3600"],  # a slow device is measured, not dropped
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            if group is not None:
                group.reset_peak()
            t0 = time.perf_counter()
            state = tmp / f"round-{model}"
            args = agent_args(model, broker.port, state, "mnist5k", "--export-dir", str(state))
            agent = subprocess.Popen(
                limited(group, [*_agent_cmd(), *args]), stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )  # fmt: skip
            _pid, status, usage = os.wait4(agent.pid, 0)
            wall = time.perf_counter() - t0
            err = agent.stderr.read().decode()[-800:] if agent.stderr else ""
            code = os.waitstatus_to_exitcode(status)
            if code != 0:
                raise RuntimeError(f"{model}: agent exited {code}: {err}")
        finally:
            serve.terminate()
            serve.wait(timeout=60)
    row = {"round_s": round(wall, 2), "peak_mib": usage.ru_maxrss // 1024}
    if group is not None:
        row["cgroup_peak_mib"] = group.peak_mib()
        row["oom_hits"] = group.failcnt()
    return row


def main(argv: list[str] | None = None) -> None:
    from coordinator.broker.embedded import MosquittoBroker
    from models import model_info

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    ap.add_argument("--repeat", type=int, default=3, help="start-up launches per model")
    ap.add_argument("--cpus", type=float, default=1.0)
    ap.add_argument("--memory", type=int, default=2 * 2**30, help="bytes")
    ap.add_argument("--no-limits", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/device_profile.json")
    args = ap.parse_args(argv)
    name = f"edgefl-profile-{os.getpid()}"
    group = None if args.no_limits else Cgroup(name, args.cpus, args.memory)
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    try:
        with tempfile.TemporaryDirectory() as tmp_dir:
            tmp = Path(tmp_dir)
            with MosquittoBroker() as broker:
                _retain_running_state(broker.port)
                for model in args.models:
                    starts = [
                        measure_start(broker.port, model, tmp, group) for _ in range(args.repeat)
                    ]
                    traced = measure_start(broker.port, model, tmp, group, importtime=True)
                    starts.sort(key=lambda r: r["start_s"])
                    mid = starts[len(starts) // 2]
                    row = {
                        "model": model,
                        "family": getattr(model_info(model), "family", "?"),
                        **mid,
                        "start_all_s": [r["start_s"] for r in starts],
                        "imports": traced["imports"],
                    }
                    row.update(measure_round(model, tmp, group))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        if group is not None:
            group.remove()
    result = {
        "command": "python benchmarks/bench_device_profile.py " + " ".join(argv or sys.argv[1:]),
        "limits": None if args.no_limits else {"cpus": args.cpus, "memory_bytes": args.memory},
        "goals": GOALS,
        "host": f"{platform.machine()} ({os.cpu_count()} CPUs)",
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


def table(result: dict[str, Any]) -> str:
    """The markdown table of a results file."""
    lines = [
        "| model | launch -> registered (median wall / agent CPU) | idle RSS | one round + export: "
        "wall, peak RSS | heaviest imports at start (ms) |",
        "|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        imports = ", ".join(f"{n} {ms:.0f}" for n, ms in r["imports"][:4])
        lines.append(
            f"| {r['model']} | {r['start_s']:.2f} s / {r['start_cpu_s']:.2f} s | "
            f"{r['idle_mib']} MiB | {r['round_s']:.1f} s, {r['peak_mib']} MiB | {imports} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
