"""``simulate(backend="ray")``: the agents in Ray actors over Mosquitto, on a local Ray instance.

The in-process backend is deterministic for a seed (the engine aggregates replies sorted by
device id; every agent seeds its own generators), so the Ray backend must give the same
per-round metrics, except what depends on the clock: timings, and the bytes of the runtime's
presence traffic that happens to fall inside a step (progress heartbeats, sent every second; a
registration repeated on seeing the coordinator's state, which may arrive after step 1 began;
the coordinator's state published again every ``state_heartbeat_s``, inside any step that a
loaded machine stretches past it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.broker.embedded import MosquittoBroker
from coordinator.cli import main
from coordinator.config import load_config
from coordinator.sim.demo import AgentProcessError
from coordinator.sim.ray_backend import RayOptions, _check_client_fits, plan_actors
from coordinator.sim.simulate import FleetSpec, simulate
from protocol.errors import ConfigError
from tests.conftest import _missing

# measured, not simulated: they differ between any two runs
TIMING_KEYS = frozenset({"samples_per_s", "train_s", "duration_s", "time", "reply_s"})
# timed by the clock, not by the run: which step counts their bytes varies
PRESENCE_BYTES = frozenset({"rx.register", "rx.status", "tx.coord_state"})
RUNTIME_KEYS = TIMING_KEYS | {"bytes_progress", "bytes_total"}
FLEET = FleetSpec(num_agents=3, models=("mlp_s",), feature_dim=32, global_test_size=200)


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[Any]:
    """A local Ray instance of 2 CPUs for the module (starting one costs seconds)."""
    try:
        import ray
    except ImportError:
        _missing("ray is not installed (pip install edgefl[ray])")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        logging_level=logging.WARNING,
        object_store_memory=100 * 1024**2,
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def simulated(value: Any) -> Any:
    """The metrics without the clock's: what two runs of one seed must agree on."""
    if isinstance(value, dict):
        return {
            k: simulated(v)
            for k, v in value.items()
            if k not in RUNTIME_KEYS and k not in PRESENCE_BYTES
        }
    if isinstance(value, list):
        return [simulated(v) for v in value]
    return value


def run(
    tmp_path: Path, name: str, fleet: FleetSpec = FLEET, algorithm: str = "fedavg", **kw: Any
) -> Any:
    cfg = load_config(
        None,
        ["hyper.local_epochs=1"],
        algorithm=algorithm,
        rounds=2,
        run_dir=str(tmp_path / name),
        min_agents=fleet.num_agents,
        deadline_s=120.0,
        wait_agents_s=120.0,
        run_id="ray-vs-inprocess",
        seed=3,
    )
    return simulate(cfg, fleet, **kw)


@pytest.mark.network
@pytest.mark.slow
def test_ray_backend_gives_the_inprocess_metrics(
    tmp_path: Path, ray_instance: Any, mosquitto: MosquittoBroker, one_thread: None
) -> None:
    # Prepare: two actors (2 + 1 agents) of one CPU and one torch thread each
    options = RayOptions(agents_per_actor=2, threads=1, broker=f"127.0.0.1:{mosquitto.port}")

    # Execute
    inprocess = run(tmp_path, "inprocess")
    on_ray = run(tmp_path, "ray", backend="ray", ray=options)

    # Assert
    assert [m["phase"] for m in on_ray.metrics] == ["train", "train", "final"]
    assert sorted(on_ray.metrics[0]["agents"]) == ["agent0", "agent1", "agent2"]
    assert on_ray.metrics[0]["bytes"]["rx.reply"] > 0
    assert simulated(on_ray.metrics) == simulated(inprocess.metrics)
    # the agents went over the real broker, under the edge-agent CLI's client ids
    log = mosquitto.log_text()
    assert all(f" as edgefl-default-agent{i} " in log for i in range(3)), log
    # each agent kept its state where the in-process agent does: under the run directory
    assert sorted(p.name for p in (tmp_path / "ray" / "agents").iterdir()) == [
        "agent0",
        "agent1",
        "agent2",
    ]


@pytest.mark.network
@pytest.mark.slow
def test_a_failing_actor_ends_the_run_at_once(
    tmp_path: Path, ray_instance: Any, mosquitto: MosquittoBroker
) -> None:
    # Prepare: agent1's model does not exist, so its actor fails while building it (under an
    # algorithm that takes mixed architectures: fedavg refuses this fleet before it starts)
    fleet = FleetSpec(num_agents=2, models=("mlp_s", "no_such_model"), feature_dim=32)
    options = RayOptions(agents_per_actor=1, threads=1, broker=f"127.0.0.1:{mosquitto.port}")

    # Execute / Assert: reported from the actor, long before wait_agents_s runs out, with the
    # toolkit's own message (as the in-process backend gives it), not Ray's traceback
    with pytest.raises(AgentProcessError, match="no_such_model") as failed:
        run(tmp_path, "failing", fleet=fleet, algorithm="fedproto", backend="ray", ray=options)
    assert str(failed.value).startswith("the Ray actor of agents 1-1 failed: "), failed.value
    assert "Traceback" not in str(failed.value) and "File " not in str(failed.value)


@pytest.mark.parametrize(
    ("agents", "options", "resources", "blocks"),
    [
        (5, RayOptions(), {"CPU": 2.0}, [range(0, 3), range(3, 5)]),
        (5, RayOptions(agents_per_actor=2), {"CPU": 4.0}, [range(0, 2), range(2, 4), range(4, 5)]),
        (3, RayOptions(actor_cpus=0.5), {"CPU": 2.0}, [range(0, 1), range(1, 2), range(2, 3)]),
        (4, RayOptions(actor_gpus=1.0), {"CPU": 8.0, "GPU": 2.0}, [range(0, 2), range(2, 4)]),
    ],
)
def test_plan_packs_the_fleet_into_actors_that_fit(
    agents: int, options: RayOptions, resources: dict[str, float], blocks: list[range]
) -> None:
    assert plan_actors(agents, options, resources) == blocks


def test_plan_refuses_actors_that_cannot_all_run_at_once() -> None:
    with pytest.raises(ConfigError, match=r"3 actors .* do not fit .* 2 CPU"):
        plan_actors(3, RayOptions(agents_per_actor=1), {"CPU": 2.0})
    with pytest.raises(ConfigError, match="0 GPU"):
        plan_actors(2, RayOptions(actor_gpus=1.0), {"CPU": 2.0})


def test_actors_of_more_paho_clients_than_a_process_holds_are_refused() -> None:
    # paho's select() loop takes no socket numbered 1024 and up, at 3 sockets a client
    with pytest.raises(ConfigError, match=r"paho: an actor of 301 agents .* 903 sockets"):
        _check_client_fits("paho", [range(0, 301), range(301, 400)])
    _check_client_fits("paho", [range(0, 300), range(300, 600)])  # raises nothing
    _check_client_fits("lean", [range(0, 5000)])  # epoll: no such bound


@pytest.mark.parametrize(
    ("field", "value"),
    [("agents_per_actor", 0), ("actor_cpus", -1.0), ("actor_gpus", -0.5), ("threads", -1)],
)
def test_options_refuse_bad_values(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        RayOptions(**{field: value})


def test_ray_flags_need_the_ray_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--agents", "2", "--actor-cpus", "2"]) == 2
    assert "--actor-cpus: only with --backend ray" in capsys.readouterr().err


def test_an_unknown_backend_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="backend: expected 'inprocess' or 'ray'"):
        run(tmp_path, "unknown", backend="dask")
