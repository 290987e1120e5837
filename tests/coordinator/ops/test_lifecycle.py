"""A run directory's life: config honoured or refused, locks, resume, finish,
Ctrl-C and `coordinator stop`, several federations on one Mosquitto, status/runs/config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from coordinator.broker.embedded import free_port
from coordinator.cli import build_parser, main
from coordinator.commands.options import resolve_run
from coordinator.config import RUN_KEY_HELP, load_config, run_keys
from coordinator.engine.runner import coordinator_client_id, make_coordinator, mqtt_transport
from coordinator.ops.lifecycle import read_run
from coordinator.store.lock import RunDirBusyError
from protocol.contract.codec import decode
from protocol.contract.messages import CoordinatorState
from protocol.contract.topics import Topics
from protocol.errors import ConfigError
from protocol.transport.base import MemoryBroker, MemoryTransport
from protocol.transport.paho import MqttTransport
from tests.helpers_runtime import InProcessAgent, run_config

BIN = Path(sys.executable).parent


def resolve(argv: list[str]):
    return resolve_run(build_parser().parse_args(argv))


def test_run_dir_from_the_toml_and_from_set_is_honoured(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(f'[run]\nrun_dir = "{tmp_path / "from-toml"}"\n')
    # Execute
    from_toml, _ = resolve(["serve", "--config", str(toml)])
    from_set, _ = resolve(["serve", "--set", f"run.run_dir={tmp_path / 'from-set'}"])
    from_flag, _ = resolve(["serve", "--config", str(toml), "--run-dir", str(tmp_path / "flag")])
    # Assert: each took effect, the flag winning over the file; run_id names the directory
    assert from_toml.run_dir == str(tmp_path / "from-toml") and from_toml.run_id == "from-toml"
    assert from_set.run_dir == str(tmp_path / "from-set")
    assert from_flag.run_dir == str(tmp_path / "flag")


def test_a_failed_start_leaves_no_run_directory(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    argv = ["serve", "--broker", f"127.0.0.1:{free_port()}", "--run-dir", str(run_dir)]
    assert main(argv) == 2
    assert "coordinator: error:" in capsys.readouterr().err
    assert not run_dir.exists()


def test_the_run_directory_is_locked_by_one_coordinator(tmp_path: Path) -> None:
    cfg = run_config(tmp_path)
    first = make_coordinator(cfg, MemoryTransport(MemoryBroker(), "c1"))
    with pytest.raises(RunDirBusyError, match=f"pid {os.getpid()}"):
        make_coordinator(cfg, MemoryTransport(MemoryBroker(), "c2"))
    assert read_run(cfg.run_dir).outcome == "running"
    first.store.close()
    make_coordinator(cfg, MemoryTransport(MemoryBroker(), "c3")).store.close()  # released


def test_resuming_with_other_settings_is_refused_and_the_record_kept(tmp_path: Path) -> None:
    # Prepare: a run that started (its store holds its config) and was interrupted
    run_dir = tmp_path / "run"
    cfg, _ = resolve(["serve", "--run-dir", str(run_dir), "--rounds", "3", "--set", "hyper.lr=0.1"])
    make_coordinator(cfg, MemoryTransport(MemoryBroker(), "c")).store.close()
    record = (run_dir / "run.json").read_text()
    # Execute / Assert: other settings are refused, naming them
    with pytest.raises(ConfigError, match=r"run\.rounds: 3 -> 5"):
        resolve(["serve", "--run-dir", str(run_dir), "--rounds", "5"])
    with pytest.raises(ConfigError, match=r"hyper\.lr: 0\.1 -> 0\.2"):
        resolve(["serve", "--run-dir", str(run_dir), "--set", "hyper.lr=0.2"])
    # the same settings, or none, or operational ones resume the run with its own settings
    again, info = resolve(["serve", "--run-dir", str(run_dir), "--set", "run.deadline_s=5"])
    assert info is not None and info.outcome == "interrupted"
    assert (again.rounds, again.algorithm_config().to_dict()["lr"], again.deadline_s) == (3, 0.1, 5)
    assert again.run_id == cfg.run_id
    assert (run_dir / "run.json").read_text() == record


def test_a_finished_run_is_reported_never_rewritten(tmp_path: Path, capsys) -> None:
    # Prepare: a finished run
    cfg = run_config(tmp_path, rounds=1)
    broker = MemoryBroker()
    agents = [InProcessAgent(cfg, broker, i).start() for i in range(3)]
    transport = MemoryTransport(broker, "coordinator")
    coord = make_coordinator(cfg, transport)
    transport.connect()
    coord.start()
    coord.run()
    coord.store.close()
    for a in agents:
        a.close()
    run_dir = Path(cfg.run_dir)
    before = {p.name: p.read_bytes() for p in (run_dir / "run.json", run_dir / "metrics.jsonl")}
    # Execute: serve it again, with the same and with other settings
    same = main(["serve", "--run-dir", str(run_dir), "--broker", f"127.0.0.1:{free_port()}"])
    out = capsys.readouterr().out
    other = main(["serve", "--run-dir", str(run_dir), "--rounds", "4"])
    err = capsys.readouterr().err
    # Assert
    assert same == 0 and "is finished" in out and "| agent0 |" in out
    assert other == 2 and "run.rounds: 1 -> 4" in err
    assert before == {p: (run_dir / p).read_bytes() for p in before}
    # ... and the lifecycle commands see it
    assert main(["runs", "--state-dir", str(tmp_path), "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)
    assert [(r["run_id"], r["outcome"], r["round"]) for r in runs] == [("t", "finished", 2)]
    assert main(["status", "--run-dir", str(run_dir), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["algorithm"] == "fedproto" and status["outcome"] == "finished"
    assert status["step"] == "round 2 final (done)"
    assert [(a["device_id"], a["arch"]) for a in status["agents"]] == [
        ("agent0", "mlp_s"),
        ("agent1", "cnn_t1"),
        ("agent2", "mlp_m"),
    ]


def test_config_defaults_lists_every_run_key_with_a_meaning(capsys) -> None:
    assert main(["config", "--defaults", "--json"]) == 0
    keys = json.loads(capsys.readouterr().out)
    assert [k["key"] for k in keys] == [k for k, *_ in run_keys()]
    assert set(RUN_KEY_HELP) == {k["key"] for k in keys}
    assert {k: v for k, v in keys[1].items() if k != "meaning"} == {
        "key": "rounds",
        "type": "int",
        "default": 10,
    }


def serve_cmd(port: int, run_dir: Path) -> list[str]:
    return [
        str(BIN / "coordinator"),
        "serve",
        "--broker",
        f"127.0.0.1:{port}",
        "--run-dir",
        str(run_dir),
        "--set",
        "run.min_agents=2",
    ]


def start_serving(port: int, run_dir: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        serve_cmd(port, run_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stderr is not None
    for line in proc.stderr:  # the log: wait until it is connected and waits for agents
        if "waiting for 2 agents" in line:
            return proc
    raise AssertionError(f"serve exited with {proc.wait()}")


def retained_state(port: int, federation: str = "default") -> CoordinatorState:
    got: list[CoordinatorState] = []
    event = threading.Event()
    client = MqttTransport(client_id="probe", port=port, clean_session=True)

    def on_state(_topic: str, data: bytes) -> None:
        got.append(decode(data).body)
        event.set()

    client.subscribe(Topics(federation).coord_state, on_state)
    client.connect()
    event.wait(10)
    client.close()
    return got[-1]


@pytest.mark.network
def test_ctrl_c_and_stop_end_serve_cleanly_and_say_how_to_resume(mosquitto, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_serving(mosquitto.port, run_dir)
    # Execute: Ctrl-C while it waits for agents
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    # Assert: no traceback, how to resume, a resumable run, the fleet told we are offline
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Resume with:" in err and str(run_dir) in err
    assert read_run(run_dir).outcome == "interrupted"
    assert retained_state(mosquitto.port).state == "offline"
    # Execute: resume it, then `coordinator stop` (SIGTERM) ends it the same way
    again = start_serving(mosquitto.port, run_dir)
    assert main(["stop", "--run-dir", str(run_dir)]) == 0
    _, err = again.communicate(timeout=60)
    assert again.returncode == 130 and "Traceback" not in err, err
    assert read_run(run_dir).outcome == "interrupted"


@pytest.mark.network
def test_two_federations_run_on_one_mosquitto_at_once(mosquitto, tmp_path: Path) -> None:
    # Prepare: federations fa and fb, one coordinator and two agents each
    from coordinator.engine.runner import run_coordinator
    from coordinator.sim.simulate import agent_options, agent_will
    from edge_agent.factory import build_agent
    from tests.helpers_runtime import FLEET

    cfgs = [
        load_config(
            None,
            ["hyper.local_epochs=1"],
            algorithm="fedproto",
            rounds=1,
            run_dir=str(tmp_path / fed),
            run_id="same-name",  # the same run name in both: still two client ids
            federation=fed,
            min_agents=2,
            deadline_s=120.0,
        )
        for fed in ("fa", "fb")
    ]
    stop = threading.Event()
    agents = []
    for cfg in cfgs:
        for i in range(2):
            opts = agent_options(cfg, FLEET, i)
            t = MqttTransport(
                client_id=f"{cfg.federation}-{opts.device_id}",
                port=mosquitto.port,
                will=agent_will(cfg.federation, opts.device_id),
            )
            agent = build_agent(opts, t)
            agent.start()
            t.connect()
            thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
            thread.start()
            agents.append((thread, t))
    results: dict[str, object] = {}

    def serve(cfg) -> None:
        transport = mqtt_transport(cfg, "127.0.0.1", mosquitto.port)
        try:
            results[cfg.federation] = run_coordinator(cfg, transport)
        except Exception as exc:  # surfaced by the assertion below
            results[cfg.federation] = exc
        finally:
            transport.close()

    # Execute
    threads = [threading.Thread(target=serve, args=(cfg,)) for cfg in cfgs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    stop.set()
    for thread, t in agents:
        thread.join(timeout=30)
        t.close()
    # Assert: both runs finished with their own two agents; distinct client ids
    assert coordinator_client_id(cfgs[0]) != coordinator_client_id(cfgs[1])
    for fed in ("fa", "fb"):
        result = results[fed]
        assert not isinstance(result, Exception), result
        assert [sorted(m["agents"]) for m in result.metrics] == [["agent0", "agent1"]] * 2
        assert retained_state(mosquitto.port, fed).state == "finished"


def test_the_demo_honours_the_config_and_refuses_what_it_decides_itself(tmp_path: Path) -> None:
    from coordinator.commands.demo import demo_config, demo_preset

    toml = tmp_path / "run.toml"
    toml.write_text('[run]\nalgorithm = "fd"\nrounds = 3\n')
    base = ["demo", "--run-dir", str(tmp_path / "d")]
    # Execute / Assert: the TOML's algorithm and rounds win over the demo's defaults
    cfg = demo_config(build_parser().parse_args([*base, "--config", str(toml)]))
    assert (cfg.algorithm, cfg.rounds) == ("fd", 3)
    cfg = demo_config(build_parser().parse_args(base))
    assert cfg.algorithm == demo_preset().settings["algorithm"] == "fedproto"  # nothing given
    # keys the demo sets itself are refused, not silently overridden
    for key in ("run.broker=h:1883", "run.min_agents=9", "run.embedded_port=1884"):
        with pytest.raises(ConfigError, match="has no effect in `coordinator demo`"):
            demo_config(build_parser().parse_args([*base, "--set", key]))


def test_a_coordinator_that_crashes_leaves_the_fleet_told_and_the_run_resumable(
    tmp_path: Path,
) -> None:
    from coordinator.engine.runner import run_coordinator

    cfg = run_config(tmp_path)
    broker = MemoryBroker()

    def crash() -> None:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        run_coordinator(cfg, MemoryTransport(broker, "coordinator"), health_check=crash)
    retained = decode(broker._retained[Topics(cfg.federation).coord_state]).body
    assert retained.state == "offline"  # not "starting" forever
    assert read_run(cfg.run_dir).outcome == "interrupted"
