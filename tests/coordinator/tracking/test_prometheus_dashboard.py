"""The Grafana dashboard shipped in ``docs/howto/grafana/`` reads only metrics the exporter
exposes, in valid PromQL, and shows every one of the exporter's own metrics (so that neither
can drift from the other)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.engine.observer import LiveRun
from coordinator.strategies import Step
from coordinator.tracking.prometheus import PrometheusExporter

DASHBOARD = Path(__file__).resolve().parents[3] / "docs/howto/grafana/edgefl-fleet.json"
METRIC = re.compile(r"\b(?:edgefl|process)_[a-z0-9_]+\b")
# Grafana's own variables, as a query sees them once Grafana has filled them in
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$job": ".*", "$instance": ".*"}
RECORD: dict[str, Any] = {
    "round": 1,
    "phase": "train",
    "duration_s": 2.0,
    "agents": {"a": {"acc_local": 0.5, "acc_global": 0.4, "num_samples": 10}},
    "mean_acc_local": 0.5,
    "mean_acc_global": 0.4,
    "bytes": {"rx.reply": 100, "tx.task": 50},
    "bytes_refused": {"rx.reply": 7},
    "bytes_progress": 3,
}


def _exposed() -> dict[str, set[str]]:
    """The sample names of an exporter that has seen every kind of event, by family."""
    exporter = PrometheusExporter()
    exporter.watch(
        LiveRun(
            run_id="r",
            algorithm="fedavg",
            federation="f",
            steps=lambda: 3,
            queue_depth=lambda: 0,
            agents_registered=lambda: 1,
            agents_online=lambda: 1,
            frames_refused=lambda: {"SignatureError": 1},
        )
    )
    exporter.step_opened(0, Step(1, "train"))
    exporter.replies_accepted(1)
    exporter.refused("late")
    exporter.heard(["a"], 1.0)
    exporter.committed(0.001)
    exporter.step_closed(RECORD)
    text = generate_latest(exporter.registry).decode()
    return {f.name: {s.name for s in f.samples} for f in text_string_to_metric_families(text)}


def _queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and query variable of the dashboard."""
    board = json.loads(DASHBOARD.read_text())
    panels = list(board["panels"])
    for row in board["panels"]:
        panels += row.get("panels", [])
    out = [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"variable {var['name']}", var["definition"]))
    return out


def test_every_panel_reads_metrics_the_exporter_exposes() -> None:
    exposed = _exposed()
    samples = set().union(*exposed.values())
    queries = _queries()
    assert len(queries) >= 12
    for where, expr in queries:
        names = METRIC.findall(expr)
        assert names, f"{where}: {expr} reads no metric of the exporter"
        unknown = [n for n in names if n not in samples]
        assert not unknown, f"{where}: {unknown} not exposed (exposed: {sorted(samples)})"
    # and every metric of the exporter's own has a panel
    read = {n for _, expr in queries for n in METRIC.findall(expr)}
    unshown = [f for f, names in exposed.items() if f.startswith("edgefl_") and not names & read]
    assert not unshown, f"no panel shows {unshown}"


def test_the_dashboard_asks_for_a_prometheus_datasource() -> None:
    board = json.loads(DASHBOARD.read_text())
    (source,) = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
    assert source["query"] == "prometheus"
    ref = {"type": "prometheus", "uid": f"${{{source['name']}}}"}
    assert all(p["datasource"] == ref for p in board["panels"])
    assert all(t["datasource"] == ref for p in board["panels"] for t in p["targets"])
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))


def _as_promql(query: str) -> str:
    """A dashboard query as Prometheus receives it from Grafana."""
    if query.startswith("label_values("):  # Grafana's, not PromQL: its selector is
        query = query.removeprefix("label_values(").rsplit(",", 1)[0]
    for variable, value in GRAFANA_VARIABLES.items():
        query = query.replace(variable, value)
    return query


def test_promtool_parses_every_query(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    rules = [
        {"record": f"dashboard:query_{i}", "expr": _as_promql(expr)}
        for i, (_where, expr) in enumerate(_queries())
    ]
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))  # YAML
    proc = subprocess.run(
        [promtool, "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
