"""``coordinator demo``: the whole system on one machine with bundled data.

An embedded MQTT broker, this process as coordinator, and N real ``edge-agent`` processes with
different architectures, each on its own Dirichlet shard of a bundled dataset (MNIST 5k by
default, or the scikit-learn digits). At the end: a per-agent table (accuracy after the first
round vs at the end, on local and global test data), the bytes exchanged per message kind, and
each agent's verified ONNX bundle.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.config import RunConfig
from coordinator.engine.core import RunResult
from coordinator.engine.runner import mqtt_transport, run_coordinator
from protocol.errors import EdgeFLError

__all__ = ["AgentProcessError", "DemoSpec", "describe_algorithm", "run_demo", "summarize"]

LOG_TAIL_LINES = 15  # of a dead agent's log, quoted in the error

log = logging.getLogger("edgefl.demo")


@dataclass(frozen=True)
class DemoSpec:
    """What the demo runs."""

    agents: int = 4
    models: tuple[str, ...] = ("cnn_t1", "mlp_s", "cnn_t2", "mlp_m", "cnn_t3")
    data: str = "digits"
    partition: str = "dirichlet:0.5"
    feature_dim: int = 64
    export: bool = True
    # the split knobs of `coordinator simulate`, passed on to every agent
    partition_file: str | None = None
    partition_seed: int | None = None
    test_fraction: float = 0.2
    min_size: int = 10
    global_test_size: int = 360
    eval_every: int = 1
    global_eval_every: int = 1


class AgentProcessError(EdgeFLError):
    """One of the demo's agent processes exited with an error before the run finished."""


@dataclass
class _AgentProc:
    index: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: Any


def _check_agents(agents: list[_AgentProc]) -> None:
    """Raise :class:`AgentProcessError` for the first agent that exited with an error.

    Without it a broken agent (bad install, missing data) would leave the coordinator waiting
    for a registration or a reply until its deadline (``wait_agents_s``, 5 min by default).
    """
    for a in agents:
        code = a.proc.poll()
        if code not in (None, 0):
            a.log_file.flush()
            lines = a.log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            tail = "\n".join(f"  | {line}" for line in lines) or "  | (empty log)"
            raise AgentProcessError(
                f"edge-agent process agent{a.index} exited with code {code} before the run "
                f"finished; the end of {a.log_path}:\n{tail}"
            )


def _agent_executable() -> list[str]:
    """The installed ``edge-agent`` script; ``python -m`` would put the working directory first
    on ``sys.path``, where any folder named like one of our packages would shadow it."""
    script = Path(sys.executable).with_name("edge-agent")
    return [str(script)] if script.exists() else [sys.executable, "-m", "edge_agent.cli"]


def _agent_cmd(cfg: RunConfig, spec: DemoSpec, port: int, i: int, run_dir: Path) -> list[str]:
    cmd = [
        *_agent_executable(),
        "--broker",
        f"127.0.0.1:{port}",
        "--id",
        f"agent{i}",
        "--federation",
        cfg.federation,
        "--algorithm",
        cfg.algorithm,
        "--model",
        spec.models[i % len(spec.models)],
        "--feature-dim",
        str(spec.feature_dim),
        "--data",
        spec.data,
        "--partition",
        spec.partition,
        "--clients",
        str(spec.agents),
        "--client-index",
        str(i),
        "--seed",
        str(cfg.seed),
        "--threads",
        "1",
        "--device",
        "cpu",
        "--state-dir",
        str(run_dir / "agents" / f"agent{i}"),
        "--log-level",
        "WARNING",
    ]
    cmd += _split_flags(spec)
    if spec.export:
        cmd += ["--export-dir", str(run_dir / "export" / f"agent{i}")]
    else:
        cmd += ["--no-export"]
    return cmd


def _split_flags(spec: DemoSpec) -> list[str]:
    """The agents' split: a partition file, or the knobs of the seeded split."""
    cmd = [
        "--test-fraction",
        str(spec.test_fraction),
        "--min-size",
        str(spec.min_size),
        "--global-test-size",
        str(spec.global_test_size),
        "--eval-every",
        str(spec.eval_every),
        "--global-eval-every",
        str(spec.global_eval_every),
    ]
    if spec.partition_seed is not None:
        cmd += ["--partition-seed", str(spec.partition_seed)]
    if spec.partition_file is not None:
        cmd += ["--partition-file", spec.partition_file]
    return cmd


def run_demo(cfg: RunConfig, spec: DemoSpec) -> RunResult:
    """Start broker and agents, coordinate the run, print the summary."""
    from coordinator.broker.embedded import EmbeddedBroker

    run_dir = Path(cfg.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    cfg = cfg.replace(min_agents=spec.agents)
    print(f"run directory: {run_dir}\n{describe_algorithm(cfg)}", flush=True)
    with EmbeddedBroker(port=0) as broker:
        log.info("embedded MQTT broker on 127.0.0.1:%d", broker.port)
        agents: list[_AgentProc] = []
        for i in range(spec.agents):
            log_path = run_dir / "logs" / f"agent{i}.log"
            out = log_path.open("w")
            proc = subprocess.Popen(
                _agent_cmd(cfg, spec, broker.port, i, run_dir), stdout=out, stderr=subprocess.STDOUT
            )
            agents.append(_AgentProc(i, proc, log_path, out))
        log.info("started %d edge-agent processes (logs in %s)", spec.agents, run_dir / "logs")
        transport = mqtt_transport(cfg, "127.0.0.1", broker.port)
        finished = False
        try:
            result = run_coordinator(cfg, transport, health_check=lambda: _check_agents(agents))
            finished = True
        finally:
            transport.close()
            # after a failed run nobody will tell the agents to stop: end them now
            _reap(agents, timeout=120.0 if finished else 0.0)
    print(summarize(result, run_dir, cfg))
    return result


def _reap(agents: list[_AgentProc], timeout: float) -> None:
    """Wait up to ``timeout`` for the agents to exit on their own, then terminate the rest."""
    end = time.monotonic() + timeout
    for a in agents:
        try:
            a.proc.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            a.proc.terminate()
            try:
                a.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                # it did not act on SIGTERM in 10 s (seen on a loaded host, mid start-up): the
                # run's own error must not be replaced by this one
                a.proc.kill()
                a.proc.wait()
        a.log_file.close()


def describe_algorithm(cfg: RunConfig) -> str:
    """``algorithm fedproto, 10 rounds: lr=0.05, ...``: what ran, in one line."""
    settings = ", ".join(f"{k}={v}" for k, v in sorted(cfg.algorithm_config().to_dict().items()))
    return f"algorithm {cfg.algorithm}, {cfg.rounds} rounds: {settings or 'no settings'}"


def summarize(result: RunResult, run_dir: Path, cfg: RunConfig | None = None) -> str:
    """Per-agent accuracy (first round vs end), traffic per message kind, export bundles."""
    train = [m for m in result.metrics if m.get("phase") == "train"]
    final = result.metrics[-1] if result.metrics else {}
    first_seen: dict[str, dict[str, Any]] = {}
    for m in train:
        for dev, a in m.get("agents", {}).items():
            first_seen.setdefault(dev, a)
    lines = [
        "",
        f"# Run {result.run_id}: {len(result.metrics)} steps",
        "",
        *([describe_algorithm(cfg), ""] if cfg is not None else []),
        "| agent | arch | local acc (round 1 -> end) | global acc (round 1 -> end) | ONNX |",
        "|---|---|---|---|---|",
    ]
    ends = sorted(final.get("agents", {}).items())
    exported = False
    for dev, a in ends:
        b = first_seen.get(dev, {})
        bundle = run_dir / "export" / dev / "manifest.json"
        written = bundle.exists()
        exported |= written
        onnx = "verified" if written and _verified(bundle) else ("written" if written else "-")
        lines.append(
            f"| {dev} | {a.get('arch')} | {_pct(b.get('acc_local'))} -> {_pct(a.get('acc_local'))} "
            f"| {_pct(b.get('acc_global'))} -> {_pct(a.get('acc_global'))} | {onnx} |"
        )
    if ends:
        lines.append(
            "| **mean** | | "
            + " | ".join(
                f"{_pct(_mean(first_seen.get(d, {}).get(key) for d, _ in ends))} -> "
                f"{_pct(_mean(a.get(key) for _, a in ends))}"
                for key in ("acc_local", "acc_global")
            )
            + " | |"
        )
    lines += [
        "",
        "local: the device's own test split (its skewed label mix); global: a held-out test set "
        "with every class.",
    ]
    traffic: dict[str, int] = {}
    for m in result.metrics:
        for k, v in m.get("bytes", {}).items():
            traffic[k] = traffic.get(k, 0) + int(v)
    lines += ["", "| direction.kind | bytes |", "|---|---|"]
    lines += [f"| {k} | {v:,} |" for k, v in sorted(traffic.items())]
    lines += [
        f"| **total** | **{sum(traffic.values()):,}** |",
        "",
        f"metrics: {run_dir / 'metrics.jsonl'}; "
        + (
            f"bundles: {run_dir / 'export'}"
            if exported
            # a "-" in every ONNX cell otherwise reads as a failed export
            else "no ONNX bundles written (simulate --export, or edge-export per device)"
        ),
    ]
    return "\n".join(lines)


def _verified(manifest: Path) -> bool:
    """Whether the bundle's fp32 file passed verification against PyTorch."""
    try:
        data = json.loads(manifest.read_text())
        ver = data["files"][0]["verification"]
    except (OSError, json.JSONDecodeError, KeyError, IndexError, TypeError):
        return False
    return isinstance(ver, dict) and ver.get("passed") is True


def _mean(values: Iterable[Any]) -> float | None:
    """Mean of the numbers among ``values``; None when there are none."""
    nums = [float(v) for v in values if isinstance(v, (int, float))]
    return sum(nums) / len(nums) if nums else None


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"
