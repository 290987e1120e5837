"""Issue 19: a whole run with the shipped commands over a provisioned, mutual-TLS Mosquitto.

``coordinator serve --kit`` and two ``edge-agent --kit`` processes, nothing else: broker
address, federation, device ids and TLS files come from the kits. The broker has only its TLS
listener, so a finished run proves the kits carry everything. A password given through the
environment (mTLS ignores it) must appear in no file the run writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.credentials import ENV
from tests.conftest import ProvisionedMosquitto
from tests.helpers_runtime import fedavg_agent_args

pytestmark = [pytest.mark.network, pytest.mark.slow]

BIN = Path(sys.executable).parent
SECRET = "do-not-store-this-password"


def agent_cmd(kit: Path, i: int, state: Path) -> list[str]:
    return [str(BIN / "edge-agent"), "--kit", str(kit), *fedavg_agent_args(i, state)]


def test_fedavg_over_mtls_with_kits_stores_no_secret(
    mosquitto_tls: ProvisionedMosquitto, tmp_path: Path
) -> None:
    # Prepare
    env = {k: v for k, v in os.environ.items() if k not in ENV.values()}
    env[ENV["password"]] = SECRET
    run_dir = tmp_path / "run"
    serve = [
        str(BIN / "coordinator"),
        "serve",
        "--kit",
        str(mosquitto_tls.kit("coordinator")),
        "--algorithm",
        "fedavg",
        "--rounds",
        "2",
        "--run-dir",
        str(run_dir),
        "--set",
        "run.min_agents=2",
        "run.deadline_s=300",
        "hyper.local_epochs=1",
    ]
    logs = {name: (tmp_path / f"{name}.log").open("wb") for name in ("coord", "a0", "a1")}
    # Execute
    coord = subprocess.Popen(serve, env=env, stdout=logs["coord"], stderr=subprocess.STDOUT)
    agents = [
        subprocess.Popen(
            agent_cmd(mosquitto_tls.kit(f"agent{i}"), i, tmp_path / f"agent{i}"),
            env=env,
            stdout=logs[f"a{i}"],
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    try:
        code = coord.wait(timeout=280)
        agent_codes = [a.wait(timeout=60) for a in agents]
    finally:
        for p in (coord, *agents):
            if p.poll() is None:
                p.kill()
        for f in logs.values():
            f.close()
    # Assert: the run finished with both agents in both rounds
    text = {name: (tmp_path / f"{name}.log").read_text() for name in logs}
    assert code == 0, text["coord"] + mosquitto_tls.log_text()
    assert agent_codes == [0, 0], text
    assert "EDGEFL_MQTT_PASSWORD" in text["coord"] and "kit " in text["coord"]  # said where from
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if m.get("phase", "train") == "train"]
    assert [m["round"] for m in train][:2] == [1, 2]
    assert all(sorted(m["agents"]) == ["agent0", "agent1"] for m in train[:2])
    assert json.loads((run_dir / "run.json").read_text())["federation"] == "tls"
    # no secret in anything the run or the agents wrote (config dump, SQLite store, logs)
    for path in [*tmp_path.rglob("*")]:
        if path.is_file():
            data = path.read_bytes()
            assert SECRET.encode() not in data, path
            assert b"PRIVATE KEY" not in data, path
