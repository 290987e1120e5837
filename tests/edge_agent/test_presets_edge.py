"""The htfllib preset's edge options: one start per architecture (``arch_init``), one shared
head (FedGen, FedGH; FedGH's server starts from it too), HtFLlib's KL mean and FD's soft
cross-entropy against hand computations, and ``client0_arch`` resolved by the coordinator."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import edge_algorithm, edge_context, fake_agent

import coordinator.strategies.fd  # registers the server halves
import coordinator.strategies.fedgen
import coordinator.strategies.fedgh
import coordinator.strategies.fml
import coordinator.strategies.local  # noqa: F401
from coordinator.strategies.base import create_strategy
from coordinator.strategies.head_training import shared_start_head
from edge_agent.algorithms import EdgeAlgorithm
from edge_agent.algorithms.fd import fd_kd_loss
from edge_agent.distillation import mutual_kl
from models import Classifier, create_model
from protocol.algorithms import config_type
from protocol.algorithms.fml import CLIENT0_ARCH, FMLConfig

C, D = 3, 4


def agent(algorithm: str, arch: str, own_seed: int, **cfg: object) -> EdgeAlgorithm:
    """An agent whose model was built from its own seed, configured with ``cfg``."""

    def build() -> Classifier:
        return create_model(arch, num_classes=C, in_chans=1, feature_dim=D, input_size=8)

    torch.manual_seed(own_seed)
    y = torch.arange(C).repeat(4)
    ctx = edge_context(build(), torch.rand(len(y), 1, 8, 8), y, num_classes=C, builder=build)
    edge = edge_algorithm(algorithm, EdgeAlgorithm, ctx)
    edge.cfg = config_type(algorithm)().replace(**cfg)
    return edge


def weights(edge: EdgeAlgorithm) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in edge.ctx.model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("algorithm", ["local", "fd"])
def test_arch_init_gives_two_agents_of_one_architecture_one_start(algorithm: str) -> None:
    a, b = agent(algorithm, "cnn_t1", 1), agent(algorithm, "cnn_t1", 2)
    a.shared_init(), b.shared_init()
    assert not same(weights(a), weights(b))  # without the option: each agent's own start
    a, b = (agent(algorithm, "cnn_t1", s, arch_init=True) for s in (1, 2))
    a.shared_init(), b.shared_init()
    assert same(weights(a), weights(b))
    other = agent(algorithm, "mlp_s", 1, arch_init=True)
    other.shared_init()
    assert not same(weights(a), weights(other))  # per architecture, not one for all


def test_arch_init_runs_once_a_restored_model_is_kept() -> None:
    a = agent("local", "cnn_t1", 1, arch_init=True)
    a.load_extra_state({})  # a checkpoint was restored: its weights are no fresh start
    before = weights(a)
    assert a.start_modules() == {}
    a.shared_init()
    assert same(before, weights(a))


@pytest.mark.parametrize("algorithm", ["fedgen", "fedgh"])
def test_shared_head_alike_across_architectures(algorithm: str) -> None:
    a, b = agent(algorithm, "cnn_t1", 1), agent(algorithm, "mlp_s", 2)
    a.shared_init(), b.shared_init()
    head = lambda e: dict(e.ctx.model.get_classifier().state_dict())  # noqa: E731
    assert not same(head(a), head(b))
    a, b = (
        agent(algorithm, arch, s, shared_head=True) for arch, s in (("cnn_t1", 1), ("mlp_s", 2))
    )
    extractor = [p.clone() for p in b.ctx.model.extractor_parameters()]
    a.shared_init(), b.shared_init()
    assert same(head(a), head(b))
    for before, after in zip(extractor, b.ctx.model.extractor_parameters(), strict=True):
        assert torch.equal(before, after)  # only the head is shared


def test_fedgh_server_starts_from_the_agents_shared_head() -> None:
    a = agent("fedgh", "cnn_t1", 1, shared_head=True)
    a.shared_init()
    server = shared_start_head("fedgh", D, C)
    own = a.ctx.model.get_classifier().state_dict()
    assert set(server.tensors) == set(own)
    for k, v in server.tensors.items():
        assert torch.equal(torch.as_tensor(v), own[k])


@pytest.mark.filterwarnings("ignore:reduction. .mean. divides")
def test_kl_mean_is_htfllib_kldivloss_default() -> None:
    student = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    teacher = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0]])
    # row 1: KL([3/4, 1/4] || [1/2, 1/2]); row 2: KL([1/2, 1/2] || [3/4, 1/4])
    r1 = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    r2 = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert mutual_kl(student, teacher).item() == pytest.approx((r1 + r2) / 2, rel=1e-5)
    hand = (r1 + r2) / 4  # nn.KLDivLoss()'s mean: over the B x C elements
    assert mutual_kl(student, teacher, "elementwise_mean").item() == pytest.approx(hand, rel=1e-5)
    kldiv = torch.nn.KLDivLoss()(student.log_softmax(1), teacher.softmax(1))
    assert mutual_kl(student, teacher, "elementwise_mean").item() == pytest.approx(kldiv.item())


def test_fd_soft_ce_over_a_batch_by_hand() -> None:
    z = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0], [5.0, 1.0]])
    t = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)], [7.0, 7.0]])
    mask = torch.tensor([True, True, False])
    # row 1: -(1/2 log 3/4 + 1/2 log 1/4); row 2: -(1/4 log 1/2 + 3/4 log 1/2); row 3 masked
    r1 = -(0.5 * math.log(0.75) + 0.5 * math.log(0.25))
    r2 = math.log(2.0)
    assert fd_kd_loss(z, t, mask, "soft_ce").item() == pytest.approx((r1 + r2) / 3, rel=1e-6)


def test_client0_arch_becomes_the_first_agents_architecture() -> None:
    cfg = FMLConfig(shared_model=CLIENT0_ARCH)
    strategy = create_strategy("fml", cfg, num_classes=4)
    fleet = []
    for device, arch in (("agent10", "mlp_s"), ("agent2", "cnn_t2"), ("agent3", "cnn_t1")):
        info = fake_agent(device, "fml", {0: 5}, arch=arch)
        strategy.admit(info, fleet)
        fleet.append(info)
    strategy.observe_fleet(fleet)  # the first step opens
    assert strategy.config.shared_model == "cnn_t2"  # agent2 comes before agent3 and agent10
    resumed = create_strategy("fml", cfg, num_classes=4)  # a restarted coordinator: no admit
    resumed.observe_fleet(fleet)
    assert resumed.config.shared_model == "cnn_t2"
    plain = create_strategy("fml", FMLConfig(), num_classes=4)
    plain.admit(fleet[0], [])
    plain.observe_fleet(fleet[:1])
    assert plain.config.shared_model == "mlp_s"  # a named model stays as named
