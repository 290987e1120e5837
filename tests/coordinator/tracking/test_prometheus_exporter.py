"""The Prometheus exporter as the engine's observer: an in-process run's scrape against what its
store and ``metrics.jsonl`` hold, the live values, and the conventions of the names."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from coordinator import accuracy
from coordinator.engine.core import Coordinator
from coordinator.engine.runner import make_coordinator
from coordinator.tracking.prometheus import PrometheusExporter
from protocol.contract.codec import Envelope, encode
from protocol.contract.messages import Status
from protocol.contract.topics import Topics
from protocol.transport.base import MemoryBroker, MemoryTransport
from tests.helpers_runtime import InProcessAgent, run_config

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    """Every sample of a scrape: (name, sorted labels) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(exporter: PrometheusExporter) -> Samples:
    return samples(generate_latest(exporter.registry).decode())


def by_label(found: Samples, name: str, label: str) -> dict[str, float]:
    return {dict(labels)[label]: v for (n, labels), v in found.items() if n == name}


@pytest.fixture(scope="module")
def finished_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[PrometheusExporter, Path, Coordinator]]:
    """A two-round FedProto run of three in-process agents, observed by an exporter, with one
    forged message refused before it starts; yields the exporter, the run directory and the
    coordinator (its store still open)."""
    cfg = run_config(tmp_path_factory.mktemp("observed"), rounds=2)
    broker = MemoryBroker()
    agents = [InProcessAgent(cfg, broker, i).start() for i in range(3)]
    exporter = PrometheusExporter()
    transport = MemoryTransport(broker, "coordinator")
    coord = make_coordinator(cfg, transport, observer=exporter)
    transport.connect()
    coord.start()
    rogue = MemoryTransport(broker, "rogue")
    rogue.connect()
    forged = Envelope(body=Status(state="online"), sender="agent1", federation=cfg.federation)
    rogue.publish(Topics(cfg.federation).status("agent0"), encode(forged))  # another's topic
    try:
        coord.run()
        yield exporter, Path(cfg.run_dir), coord
    finally:
        coord.store.close()
        for a in agents:
            a.close()


def test_the_scrape_of_a_finished_run_holds_what_its_store_records(finished_run) -> None:
    exporter, run_dir, coord = finished_run
    found = scrape(exporter)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    # steps, round and the plan
    closed = by_label(found, "edgefl_steps_closed_total", "phase")
    assert sum(closed.values()) == len(records) == found[("edgefl_steps_planned", ())]
    assert found[("edgefl_step", ())] == len(records)
    assert found[("edgefl_round", ())] == last["round"]
    # replies: every one the records name; refusals as the engine counted them
    assert found[("edgefl_replies_accepted_total", ())] == sum(len(r["agents"]) for r in records)
    refused = by_label(found, "edgefl_messages_refused_total", "reason")
    assert refused == coord.rejected == {"sender_mismatch": 1}
    # bytes per direction and kind: the records' sums
    want: dict[str, int] = {}
    for r in records:
        for key, n in r["bytes"].items():
            want[key] = want.get(key, 0) + n
    got = {
        f"{dict(labels)['direction']}.{dict(labels)['kind']}": v
        for (name, labels), v in found.items()
        if name == "edgefl_message_bytes_total" and dict(labels)["kind"] != "progress"
    }
    assert got == want and want["rx.reply"] > 0
    # the last step of each phase: its duration and accuracy, as recorded
    train = [r for r in records if r["phase"] == "train"][-1]
    key = ("edgefl_step_duration_seconds", (("phase", "train"),))
    assert found[key] == train["duration_s"]
    acc = by_label(
        {k: v for k, v in found.items() if ("phase", "train") in k[1]},
        "edgefl_accuracy_ratio",
        "measure",
    )
    assert acc == {
        "acc_local": train["mean_acc_local"],
        "acc_global": train["mean_acc_global"],
        "acc_local_weighted": accuracy.round_value(train, accuracy.PERSONALISED),
    }
    # each agent's last seen: exactly the store's
    seen = by_label(found, "edgefl_agent_last_seen_timestamp_seconds", "agent")
    assert seen == {d: t for d, _reg, _online, t in coord.store.agent_rows()}
    # the store's commits were timed, the run named
    assert found[("edgefl_store_commit_duration_seconds_count", ())] >= len(records)
    run_info = [dict(labels) for (n, labels), _ in found.items() if n == "edgefl_run_info"]
    assert run_info == [{"run_id": "t", "algorithm": "fedproto", "federation": "default"}]


def test_the_ingest_queue_depth_is_read_at_each_scrape(tmp_path: Path) -> None:
    exporter = PrometheusExporter()
    coord = make_coordinator(
        run_config(tmp_path), MemoryTransport(MemoryBroker(), "c"), observer=exporter
    )
    try:
        assert ("edgefl_ingest_queue_messages", ()) not in scrape(exporter)  # not started
        coord.start()
        env = Envelope(body=Status(state="online"), sender="agent0", federation="default")
        for _ in range(3):
            coord.inbox.put((env, "topic"))
        assert scrape(exporter)[("edgefl_ingest_queue_messages", ())] == 3
        coord._pump(0.0)  # the engine takes them
        assert scrape(exporter)[("edgefl_ingest_queue_messages", ())] == 0
    finally:
        coord.store.close()


def test_promtool_finds_the_names_conventional(finished_run) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    exporter, _run_dir, _coord = finished_run
    text = generate_latest(exporter.registry)
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=60, check=False
    )
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr
