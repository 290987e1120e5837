"""``simulate(backend="ray")`` on a Ray cluster of two nodes, joined by address.

``ray.cluster_utils.Cluster`` starts a head and a second node, each its own raylet and object
store, on this machine: actors that do not fit one node are placed on the other, and the driver
joins by the cluster's address (the ``--ray-address`` path), as it would a cluster of machines.
Both nodes share this host's loopback, so a broker started here is reachable; a cluster over
several hosts needs ``--broker`` (refused without it: the last tests).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from coordinator.broker.embedded import MosquittoBroker
from coordinator.sim.demo import AgentProcessError
from coordinator.sim.ray_backend import RayOptions, _check_loopback_reaches, _placement
from protocol.errors import ConfigError
from tests.conftest import _missing
from tests.coordinator.sim.test_simulate_ray import run, simulated


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Any]:
    """A head node and a worker node of one CPU each; no driver connected to it."""
    try:
        from ray.cluster_utils import Cluster
    except ImportError:
        _missing("ray is not installed (pip install edgefl[ray])")
    store = 80 * 1024**2  # the actors exchange only their arguments: spare /dev/shm
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "object_store_memory": store},
    )
    try:
        cluster.add_node(num_cpus=1, object_store_memory=store)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


@pytest.mark.network
@pytest.mark.slow
def test_actors_spread_over_two_nodes_give_the_inprocess_metrics(
    tmp_path: Path,
    two_nodes: Any,
    mosquitto: MosquittoBroker,
    one_thread: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: two actors of one CPU (2 + 1 agents) on two nodes of one CPU: one a node
    options = RayOptions(
        address=two_nodes.address,
        agents_per_actor=2,
        threads=1,
        broker=f"127.0.0.1:{mosquitto.port}",
    )
    caplog.set_level(logging.INFO, logger="edgefl.simulate")

    # Execute
    inprocess = run(tmp_path, "inprocess")
    on_cluster = run(tmp_path, "cluster", backend="ray", ray=options)

    # Assert: the same run as in one process, from actors on two raylets
    assert simulated(on_cluster.metrics) == simulated(inprocess.metrics)
    placed = re.findall(r"agents (\d+-\d+): Ray node (\w+)", caplog.text)
    assert len(placed) == 2, caplog.text
    assert sorted(block for block, _ in placed) == ["0-1", "2-2"]
    assert len({node for _, node in placed}) == 2, caplog.text
    assert "3 agents in 2 Ray actors on 2 node(s)" in caplog.text
    # the driver joined by address and left; the cluster outlives the run
    import ray

    assert not ray.is_initialized()
    assert len([n for n in ray_nodes(two_nodes) if n["Alive"]]) == 2


def ray_nodes(cluster: Any) -> list[dict[str, Any]]:
    """The cluster's nodes, from a driver connected for the question only."""
    import ray

    ray.init(address=cluster.address, logging_level=logging.WARNING)
    try:
        nodes: list[dict[str, Any]] = ray.nodes()
        return nodes
    finally:
        ray.shutdown()


def node(ip: str, *, alive: bool = True) -> dict[str, Any]:
    return {"NodeManagerAddress": ip, "Alive": alive}


def test_a_loopback_broker_is_refused_when_a_node_is_another_host() -> None:
    nodes = [node("10.0.0.5"), node("10.0.0.6"), node("10.0.0.7")]
    with pytest.raises(ConfigError, match=r"other hosts \(10\.0\.0\.6, 10\.0\.0\.7\).*--broker"):
        _check_loopback_reaches(nodes, "10.0.0.5")


def test_a_loopback_broker_serves_nodes_of_this_host_and_ignores_dead_ones() -> None:
    nodes = [node("10.0.0.5"), node("10.0.0.5"), node("10.0.0.9", alive=False)]
    _check_loopback_reaches(nodes, "10.0.0.5")  # raises nothing


def test_actors_that_do_not_all_start_in_time_fail_the_run() -> None:
    # Prepare: a Ray whose ``get`` of the actors' placements times out
    try:
        import ray
    except ImportError:
        _missing("ray is not installed (pip install edgefl[ray])")

    def get(refs: list[Any], timeout: float) -> None:
        raise ray.exceptions.GetTimeoutError(f"{len(refs)} refs, {timeout} s")

    fake = SimpleNamespace(get=get, exceptions=ray.exceptions)

    # Execute / Assert: named for the setting that bounds it
    with pytest.raises(AgentProcessError, match=r"not all of 2 Ray actors started within 7 s"):
        _placement(fake, ["a", "b"], [range(0, 2), range(2, 3)], timeout=7.0)
