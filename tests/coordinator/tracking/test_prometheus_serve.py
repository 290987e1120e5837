"""``coordinator serve --metrics-port`` in a real run on Mosquitto: ``/metrics`` scraped over HTTP
while two ``edge-agent`` processes train, checked against the run's store and
``metrics.jsonl``, and scraped by a real Prometheus (Debian's ``prometheus``) as configured in
``docs/howto/monitor-with-prometheus.md``.

One run serves both tests (a run costs a minute on a loaded machine): the fixture observes it,
holding it in its second step while it looks, and keeps what it saw; each test judges its part.
"""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_for

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families

from coordinator.broker.embedded import MosquittoBroker, free_port
from protocol.contract.codec import Envelope, encode
from protocol.contract.messages import Status
from protocol.contract.topics import Topics
from protocol.transport.paho import MqttTransport
from tests.helpers_runtime import Fleet, clean_env, fedavg_agent_args

BIN = Path(sys.executable).parent
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _samples(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _total(found: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in found.items() if n == name and want <= set(ls))


@dataclass
class Seen:
    """What the fixture saw during the run."""

    run_dir: Path
    codes: dict[str, int] = field(default_factory=dict)
    logs: str = ""
    consistent: Samples = field(default_factory=dict)  # a scrape no step closed during
    last_seen_matched: bool = False  # a scrape's last-seen times equal the store's
    refused: Samples = field(default_factory=dict)  # a scrape after the forged message
    prometheus: dict[str, Any] | None = None  # Prometheus' answers; None: not installed


class Prometheus:
    """Debian's prometheus on a free loopback port, scraping ``target`` every second."""

    def __init__(self, binary: str, target: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="edgefl-prom-"))
        self.port = free_port()
        config = self.dir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n"
            f"scrape_configs:\n  - job_name: edgefl\n    static_configs:\n"
            f"      - targets: ['{target}']\n"
        )
        self.log = (self.dir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector of ``expr`` (empty while Prometheus is not up)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": expr}
        )
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                result: list[dict[str, Any]] = json.load(resp)["data"]["result"]
                return result
        except OSError:
            return []

    def close(self) -> str:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        text = (self.dir / "prometheus.log").read_text(errors="replace")
        shutil.rmtree(self.dir, ignore_errors=True)
        return text


def _scrape(port: int) -> Samples:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return _samples(resp.read().decode())
    except OSError:  # not serving yet, or gone
        return {}


def _store_last_seen(run_dir: Path) -> dict[str, float]:
    db = sqlite3.connect(f"file:{run_dir / 'state.sqlite'}?mode=ro", uri=True, timeout=10)
    try:
        return {d: t for d, t in db.execute("SELECT device_id, last_seen FROM agents")}
    except sqlite3.Error:  # not created yet
        return {}
    finally:
        db.close()


def _last_seen(found: Samples) -> dict[str, float]:
    name = "edgefl_agent_last_seen_timestamp_seconds"
    return {dict(ls)["agent"]: v for (n, ls), v in found.items() if n == name}


@pytest.fixture(scope="module")
def observed_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seen]:
    from coordinator.broker.embedded import mosquitto_executable

    if mosquitto_executable() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    tmp = tmp_path_factory.mktemp("served")
    broker = MosquittoBroker()
    broker.start()
    metrics_port = free_port()
    binary = shutil.which("prometheus")
    prom = Prometheus(binary, f"127.0.0.1:{metrics_port}") if binary else None
    seen, fleet = Seen(tmp / "run"), Fleet(tmp)
    address, env = f"127.0.0.1:{broker.port}", clean_env()
    rogue = MqttTransport(client_id="rogue", port=broker.port, connect_timeout=5)
    rogue.connect()
    try:
        serve = [str(BIN / "coordinator"), "serve", "--broker", address, "--algorithm", "fedavg"]
        serve += ["--rounds", "2", "--run-dir", str(seen.run_dir)]
        serve += ["--metrics-port", str(metrics_port), "--set", "run.min_agents=2"]
        serve += ["run.deadline_s=120", "hyper.local_epochs=1"]
        fleet.start("coord", serve, env)
        for i in range(2):
            argv = [str(BIN / "edge-agent"), "--broker", address, "--id", f"agent{i}"]
            fleet.start(f"a{i}", argv + fedavg_agent_args(i, tmp / f"agent{i}"), env)

        def scraped(name: str, at_least: float) -> bool:
            return _total(_scrape(metrics_port), name) >= at_least

        # Execute: hold the run in its second step long enough to look at it: agent1 sleeps
        # (SIGSTOP) once both agents registered, agent0 once it replied in step 1; agent1 then
        # closes step 1 and answers step 2, which waits for agent0 until it wakes
        assert wait_for(lambda: scraped("edgefl_agents_registered", 2), 180, 0.05), fleet.logs()
        fleet.procs["a1"].send_signal(signal.SIGSTOP)
        assert wait_for(lambda: scraped("edgefl_replies_accepted_total", 1), 180, 0.05)
        fleet.procs["a0"].send_signal(signal.SIGSTOP)
        fleet.procs["a1"].send_signal(signal.SIGCONT)
        # a status in agent1's name on agent0's topic: refused once
        forged = Envelope(body=Status(state="online"), sender="agent1", federation="default")
        rogue.publish(Topics("default").status("agent0"), encode(forged))
        assert wait_for(lambda: scraped("edgefl_messages_refused_total", 1), 60, 0.05)
        seen.refused = _scrape(metrics_port)
        seen.consistent = _consistent_scrape(metrics_port)
        seen.last_seen_matched = wait_for(
            lambda: _last_seen(_scrape(metrics_port)) == _store_last_seen(seen.run_dir) != {},
            120,
            0.05,
        )
        if prom is not None:
            seen.prometheus = _ask(prom)
        fleet.procs["a0"].send_signal(signal.SIGCONT)
        seen.codes = fleet.wait()
    finally:
        for proc in fleet.procs.values():  # none left asleep, whatever failed
            proc.send_signal(signal.SIGCONT)
        rogue.close()
        prom_log = prom.close() if prom is not None else ""
        broker.cleanup()
        seen.logs = fleet.logs() + "\n--- prometheus\n" + prom_log
    yield seen


def _consistent_scrape(port: int) -> Samples:
    """A scrape taken after the first step closed, during which no step closed (the next
    scrape counts as many closed steps): its per-step counters are those of the records so far."""
    closed = "edgefl_steps_closed_total"
    found: dict[str, Samples] = {}

    def stable() -> bool:
        first, second = _scrape(port), _scrape(port)
        found["it"] = first
        return _total(first, closed) >= 1 and _total(first, closed) == _total(second, closed)

    assert wait_for(stable, 240, 0.1)
    return found["it"]


def _ask(prom: Prometheus) -> dict[str, Any]:
    """Prometheus' answers once it has scraped a closed step (over the last minutes: a series
    of a run that has ended is stale at once)."""
    answers: dict[str, Any] = {}

    def scraped() -> bool:
        answers["closed"] = prom.query("max(max_over_time(edgefl_steps_closed_total[10m]))")
        return bool(answers["closed"]) and float(answers["closed"][0]["value"][1]) >= 1

    answers["scraped"] = wait_for(scraped, 120, 0.5)
    answers["up"] = prom.query('max_over_time(up{job="edgefl"}[10m])')
    answers["run"] = prom.query("last_over_time(edgefl_run_info[10m])")
    answers["accuracy"] = prom.query(
        'last_over_time(edgefl_accuracy_ratio{phase="train",measure="acc_local"}[10m])'
    )
    return answers


@pytest.mark.network
@pytest.mark.slow
def test_metrics_scraped_during_a_served_run_match_its_store(observed_run: Seen) -> None:
    seen = observed_run
    assert seen.codes == {"coord": 0, "a0": 0, "a1": 0}, seen.logs
    records = [json.loads(x) for x in (seen.run_dir / "metrics.jsonl").read_text().splitlines()]
    found = seen.consistent
    n = int(_total(found, "edgefl_steps_closed_total"))
    so_far, after = records[:n], records[: n + 1]
    # round and step: of the step open, or last open
    assert found[("edgefl_step", ())] in (n, n + 1)
    assert found[("edgefl_round", ())] in {r["round"] for r in after}
    assert found[("edgefl_steps_planned", ())] == len(records)
    # bytes by kind: what the closed steps recorded
    for key in {k for r in so_far for k in r["bytes"]}:
        direction, kind = key.split(".", 1)
        want = sum(r["bytes"].get(key, 0) for r in so_far)
        assert _total(found, "edgefl_message_bytes_total", direction=direction, kind=kind) == want
    # replies: the closed steps' and at most the next one's
    accepted = found[("edgefl_replies_accepted_total", ())]
    assert sum(len(r["agents"]) for r in so_far) <= accepted <= sum(len(r["agents"]) for r in after)
    # the last closed training step's duration and accuracy
    train = [r for r in so_far if r["phase"] == "train"][-1]
    assert found[("edgefl_step_duration_seconds", (("phase", "train"),))] == train["duration_s"]
    key = ("edgefl_accuracy_ratio", (("measure", "acc_local"), ("phase", "train")))
    assert found[key] == train["mean_acc_local"]
    # live values: the fleet, the queue, the commits; the forged status refused once
    assert found[("edgefl_agents_registered", ())] == 2
    assert found[("edgefl_ingest_queue_messages", ())] >= 0
    assert found[("edgefl_store_commit_duration_seconds_count", ())] >= n
    name = "edgefl_messages_refused_total"
    refused = {dict(ls)["reason"]: v for (m, ls), v in seen.refused.items() if m == name}
    assert refused == {"sender_mismatch": 1}, seen.logs
    # each agent's last seen: the store's, to the microsecond, at some scrape of the run
    assert seen.last_seen_matched, seen.logs


@pytest.mark.network
@pytest.mark.slow
def test_a_real_prometheus_scrapes_the_served_run(observed_run: Seen) -> None:
    seen = observed_run
    if seen.prometheus is None:
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    answers = seen.prometheus
    assert answers["scraped"], seen.logs
    assert [a["value"][1] for a in answers["up"]] == ["1"]
    assert [a["metric"]["run_id"] for a in answers["run"]] == ["run"]
    records = [json.loads(x) for x in (seen.run_dir / "metrics.jsonl").read_text().splitlines()]
    accuracies = {r["mean_acc_local"] for r in records if r["phase"] == "train"}
    assert [float(a["value"][1]) in accuracies for a in answers["accuracy"]] == [True]
