"""FedAvg refuses, at registration, an agent whose model cannot be averaged with the fleet's."""

import pytest
from helpers import fake_agent

from coordinator.strategies import AgentInfo, create_strategy
from protocol.algorithms import config_type
from protocol.errors import AdmissionError


def agent(
    device_id: str, arch: str, params: int = 100, size: int = 8, algorithm: str = "fedavg"
) -> AgentInfo:
    return fake_agent(
        device_id, algorithm, {0: 5}, arch=arch, num_params=params, input_spec=(1, size, size)
    )


def test_fedavg_admits_one_architecture_and_names_the_mismatch() -> None:
    s = create_strategy("fedavg", config_type("fedavg")(), num_classes=4)
    fleet = [agent("a", "mlp_s")]
    s.admit(agent("b", "mlp_s"), fleet)  # same architecture: admitted
    s.admit(agent("a", "cnn_t1"), fleet)  # the only member re-registering: nothing to match
    with pytest.raises(AdmissionError, match=r"fleet runs mlp_s .* this agent cnn_t1"):
        s.admit(agent("c", "cnn_t1"), fleet)
    with pytest.raises(AdmissionError, match="input 1x28x28"):
        s.admit(agent("d", "mlp_s", size=28), fleet)


@pytest.mark.parametrize("name", ["fedavg", "ccvr"])
def test_the_refusal_names_the_runs_own_algorithm(name: str) -> None:
    s = create_strategy(name, config_type(name)(), num_classes=4)
    with pytest.raises(AdmissionError, match=f"refused: {name} averages one architecture"):
        s.admit(agent("c", "cnn_t1", algorithm=name), [agent("a", "mlp_s", algorithm=name)])
