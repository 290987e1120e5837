"""A run directory's life: new, running, interrupted, finished or failed; resume and listing.

torch-free: ``coordinator runs``, ``status``, ``stop`` and ``config`` import only this module,
the store and the config.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from coordinator.config import RunConfig, build_config
from coordinator.store.lock import lock_holder
from protocol.errors import ConfigError

__all__ = [
    "OPERATIONAL_KEYS",
    "AgentRow",
    "RunInfo",
    "list_runs",
    "read_run",
    "resolve_config",
]

Outcome = Literal["new", "running", "interrupted", "finished", "failed"]

# Keys a resumed run may change: how the coordinator reaches the fleet and how long it waits,
# none of what the run computes. Any other key differing from the stored run is an error.
OPERATIONAL_KEYS = frozenset(
    {
        "broker",
        "embedded_port",
        "embedded_host",
        "wait_agents_s",
        "rejoin_wait_s",
        "deadline_s",
        "deadline_mode",
        "deadline_quantile",
        "deadline_margin",
        "deadline_min_s",
        "grace_s",
        "max_retries",
        "min_agents",
        "server_device",
        "run_dir",
        # how the same knowledge reaches the agents (once on bcast/knowledge or in every task)
        "broadcast",
        "broadcast_min_bytes",
        "state_heartbeat_s",
        # who takes the replies (the engine or ingest workers): the same checks either way
        "ingest_workers",
        # where the figures are also sent: the run computes the same
        "trackers",
        "tracking_uri",
    }
)


@dataclass(frozen=True)
class AgentRow:
    """One agent as the run's store last saw it."""

    device_id: str
    arch: str
    online: bool
    last_seen: float
    dp_epsilon: float | None = None  # privacy budget spent (hyper.dp), per its latest reply
    # the device answered a step with PrivacyBudgetError: the run selects it for no more steps
    budget_spent: bool = False


@dataclass(frozen=True)
class RunInfo:
    """What a run directory holds, read without disturbing a coordinator that is using it."""

    run_dir: Path
    config: dict[str, Any]
    outcome: Outcome
    steps_done: int
    round: int  # round of the last closed step (0 before the first)
    pid: int | None  # the coordinator holding the directory, if one does
    started: float | None
    step: str = ""  # the latest step: "round 2 train (open)"
    agents: tuple[AgentRow, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form (``--json``)."""
        out = dataclasses.asdict(self)
        out["run_dir"] = str(self.run_dir)
        out["algorithm"] = self.config.get("algorithm")
        out["federation"] = self.config.get("federation")
        out["run_id"] = self.config.get("run_id")
        out["rounds"] = self.config.get("rounds")
        return out


def read_run(run_dir: Path | str) -> RunInfo | None:
    """The run in ``run_dir``, or ``None`` if it holds none (no coordinator database)."""
    run_dir = Path(run_dir)
    db_path = run_dir / "state.sqlite"
    if not db_path.is_file():
        return None
    pid = lock_holder(run_dir)
    try:
        db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5)
        try:
            return _read(db, run_dir, pid)
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise ConfigError(f"{db_path}: unreadable coordinator database: {exc}") from exc


def _read(db: sqlite3.Connection, run_dir: Path, pid: int | None) -> RunInfo:
    import json

    meta = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM meta")}
    done, last_round = db.execute(
        "SELECT COUNT(*), MAX(round) FROM steps WHERE status='done'"
    ).fetchone()
    started = db.execute("SELECT MIN(started) FROM steps").fetchone()[0]
    latest = db.execute(
        "SELECT round, phase, status, attempt FROM steps ORDER BY idx DESC LIMIT 1"
    ).fetchone()
    step = "" if latest is None else f"round {latest[0]} {latest[1]} ({latest[2]}"
    step += "" if latest is None else (f", attempt {latest[3] + 1})" if latest[3] else ")")
    hyper = (meta.get("config") or {}).get("hyper") or {}
    spent, exhausted = _epsilons(db) if hyper.get("dp_epsilon") else ({}, set())
    agents = tuple(
        AgentRow(d, _arch(blob), bool(online), float(seen), spent.get(d), d in exhausted)
        for d, blob, online, seen in db.execute(
            "SELECT device_id, register, online, last_seen FROM agents ORDER BY device_id"
        )
    )
    stored = meta.get("outcome")
    outcome: Outcome
    if pid is not None:
        outcome = "running"
    elif stored in ("finished", "failed"):
        outcome = stored
    else:  # a coordinator that was running, stopped or killed: resumable
        outcome = "interrupted" if meta.get("config") else "new"
    return RunInfo(
        run_dir=run_dir,
        config=meta.get("config") or {},
        outcome=outcome,
        steps_done=int(done or 0),
        round=int(last_round or 0),
        pid=pid,
        started=started,
        step=step,
        agents=agents,
    )


def _epsilons(db: sqlite3.Connection) -> tuple[dict[str, float], set[str]]:
    """Each device's ``dp_epsilon`` as its latest reply reported it (step records, newest
    first; read only for a run with ``hyper.dp``), and the devices a step recorded as failed
    with their budget spent (``failed``: device -> "code: reason")."""
    import json

    from protocol.contract.messages import BUDGET_SPENT

    out: dict[str, float] = {}
    exhausted: set[str] = set()
    for (text,) in db.execute("SELECT record FROM metrics ORDER BY step DESC"):
        record = json.loads(text)
        for device, metrics in (record.get("agents") or {}).items():
            value = metrics.get("dp_epsilon") if isinstance(metrics, dict) else None
            if device not in out and isinstance(value, (int, float)):
                out[device] = float(value)
        failed = record.get("failed")
        if isinstance(failed, dict):
            exhausted |= {d for d, why in failed.items() if str(why).startswith(BUDGET_SPENT)}
    return out, exhausted


def _arch(blob: bytes) -> str:
    from protocol.contract.codec import decode
    from protocol.contract.messages import Register
    from protocol.errors import ProtocolError

    try:
        body = decode(blob).body
    except ProtocolError:
        return "?"
    return body.arch if isinstance(body, Register) else "?"


def list_runs(state_dir: Path | str) -> list[RunInfo]:
    """Every run directly under ``state_dir``, oldest first."""
    root = Path(state_dir)
    if not root.is_dir():
        raise ConfigError(f"state directory {root} does not exist")
    runs = [info for d in sorted(root.iterdir()) if d.is_dir() and (info := read_run(d))]
    return sorted(runs, key=lambda r: (r.started or time.time(), str(r.run_dir)))


def resolve_config(data: dict[str, dict[str, Any]]) -> tuple[RunConfig, RunInfo | None]:
    """The config to run with, given the user's layers (``read_layers``) with ``run.run_dir``.

    A new run directory takes the layers as they are. A directory that holds a run resumes it
    with its stored settings; a given value that changes what the run computes is an error
    (resuming with other settings would report a mix of two runs), as is a run that is already
    finished (it is reported, never rewritten) or held by another coordinator.
    """
    run_dir = Path(str(data["run"]["run_dir"]))
    info = read_run(run_dir)
    if info is None or not info.config:
        return build_config(data), None
    if info.outcome == "running":
        raise ConfigError(f"run {run_dir} is in use by another coordinator (pid {info.pid})")
    cfg = build_config(data, base=info.config)
    changed = _changed(info.config, cfg.to_dict())
    if changed:
        raise ConfigError(
            f"run {run_dir} was started with other settings ({'; '.join(changed)}): a run "
            "keeps its settings; resume it without them or choose a new --run-dir"
        )
    return cfg, info


def _changed(stored: dict[str, Any], now: dict[str, Any]) -> list[str]:
    out = [
        f"run.{k}: {stored.get(k)!r} -> {v!r}"
        for k, v in sorted(now.items())
        if k != "hyper" and k not in OPERATIONAL_KEYS and k in stored and stored[k] != v
    ]
    old_hyper = stored.get("hyper") or {}
    out += [
        f"hyper.{k}: {old_hyper.get(k)!r} -> {v!r}"
        for k, v in sorted((now.get("hyper") or {}).items())
        if k in old_hyper and old_hyper[k] != v
    ]
    return out
