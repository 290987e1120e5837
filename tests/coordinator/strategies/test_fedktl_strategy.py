"""FedKTL server half: the set-up sent once per agent, replies checked, F and the centroids
aligned and turned into one image per class at each agent's input spec, the durable state a
restarted coordinator continues from, and generator errors before round 1."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import fake_agent
from torch import Tensor, nn

import coordinator.strategies.fedktl.strategy
import edge_agent.algorithms.fedktl  # noqa: F401  (registers both halves)
from coordinator.strategies import AgentInfo, ServerContext, Step, create_strategy
from coordinator.strategies.fedktl.server import VALID_KEY
from coordinator.strategies.fedktl.strategy import FedKTLStrategy
from models.generators import GeneratorError
from protocol.algorithms.fedktl import FedKTLConfig, setup_digest
from protocol.contract.messages import Reply
from protocol.contract.payloads import ImageVectorPairs, PrototypeSet, TensorMap
from protocol.errors import AdmissionError, ConfigError, ValidationError

_ = coordinator.strategies.fedktl.strategy
C = 4
CPPN = {"generator": "cppn", "cppn_w_dim": 8, "cppn_resolution": 16, "server_epochs": 3}


def agent(device_id: str, classes: list[int], spec: tuple[int, int, int] = (1, 8, 8)) -> AgentInfo:
    counts = dict.fromkeys(classes, 5)
    return fake_agent(device_id, "fedktl", counts, num_classes=C, arch="mlp_s", input_spec=spec)


A = agent("a", [0, 1])
B = agent("b", [1, 2], (3, 12, 12))


def strategy(**hyper: object) -> FedKTLStrategy:
    cfg = FedKTLConfig.from_dict({**CPPN, **hyper})
    s = create_strategy("fedktl", cfg, num_classes=C, seed=5)
    assert isinstance(s, FedKTLStrategy)
    s.plan(3)
    return s


def protos(ids: list[int], seed: int = 0, k: int = C) -> PrototypeSet:
    v = np.random.default_rng(seed).standard_normal((len(ids), k)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return PrototypeSet(np.array(ids, np.int32), v, np.full(len(ids), 5, np.int32))


def reply(p: PrototypeSet, round_: int = 1) -> Reply:
    return Reply(task_id="t", round=round_, phase="train", num_samples=10, payloads={"protos": p})


def one_round(s: FedKTLStrategy, r: int = 1, seed: int = 3) -> dict[str, float]:
    step = Step(r, "train")
    s.aggregate(step, [(A, reply(protos([0, 1], r), r)), (B, reply(protos([1, 2], r + 9), r))])
    return s.server_train(step, ServerContext.for_step(seed, r - 1, "cpu"))


def test_set_up_goes_to_each_agent_until_a_reply_proves_it_holds_it() -> None:
    # Prepare
    s = strategy()
    setup = s.configure(Step(1, "train"), A)["setup"]

    # Execute
    one_round(s)
    after = s.configure(Step(2, "train"), A)
    newcomer = s.configure(Step(2, "train"), agent("c", [3]))

    # Assert: the config names the set-up's digest; sizes resolved from the generator
    assert isinstance(setup, TensorMap)
    assert s.config.setup_sha256 == setup_digest(setup.tensors)
    assert (s.config.etf_dim, s.config.latent_dim) == (C, 8)
    assert setup.tensors["etf"].shape == (C, C)
    assert setup.tensors["proj.weight"].shape == (8, s.config.feature_dim)
    assert "setup" not in after and "setup" in newcomer
    assert s.holders == {"a": 1, "b": 1}


def test_round_one_carries_no_pairs_then_each_agent_gets_its_own_resolution() -> None:
    # Prepare
    s = strategy()
    assert set(s.configure(Step(1, "train"), A)) == {"setup"}

    # Execute
    metrics = one_round(s)
    to_a, to_b = s.configure(Step(2, "train"), A), s.configure(Step(2, "train"), B)

    # Assert: classes 0-2 reported, class 3 never: masked; latents float32 [3, H]
    pa, pb = to_a["pairs"], to_b["pairs"]
    assert isinstance(pa, ImageVectorPairs) and isinstance(pb, ImageVectorPairs)
    assert pa.images.shape == (3, 1, 8, 8) and pb.images.shape == (3, 3, 12, 12)
    assert pa.images.dtype == np.uint8 and pa.vectors.dtype == np.float32
    np.testing.assert_array_equal(pa.vectors, pb.vectors)
    assert set(to_b) == {"pairs"}  # the classes and round travel inside the pairs
    assert pb.class_ids is not None and pb.class_ids.tolist() == [0, 1, 2] and pb.round == 1
    assert metrics["ktl_steps"] == 3 and metrics["ktl_classes"] == 3
    assert np.isfinite([metrics["ktl_mmd"], metrics["ktl_mse"], metrics["ktl_kernel_xy"]]).all()
    assert metrics["ktl_centroid_dist_min"] > 0


def test_centroids_are_the_exact_class_means_of_f_after_training() -> None:
    s = strategy()
    one_round(s)
    assert s.aligner is not None
    from coordinator.strategies.fedktl.server import Aligner

    al = Aligner(C, 8, C)
    state = {k: torch.as_tensor(s.aligner.tensors[k]) for k in al.state_dict()}
    al.load_state_dict(state)
    al.eval()
    a, b = protos([0, 1], 1), protos([1, 2], 10)
    with torch.no_grad():
        qa, qb = (
            al.transformer(torch.as_tensor(a.vectors)),
            al.transformer(torch.as_tensor(b.vectors)),
        )
    cent = s.aligner.tensors["centroids.weight"]
    np.testing.assert_allclose(cent[1], ((qa[1] + qb[0]) / 2).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cent[0], qa[0].numpy(), rtol=1e-5, atol=1e-6)
    assert s.aligner.tensors[VALID_KEY].tolist() == [True, True, True, False]


def test_a_stale_replys_prototypes_weigh_its_staleness_weight_in_the_centroids() -> None:
    s = strategy()
    stale = Reply(
        task_id="tb",
        round=1,
        phase="train",
        num_samples=10,
        payloads={"protos": protos([1, 2], 10)},
    )
    s.staleness_weights = {"tb": 0.25}  # b answers a task two versions old
    step = Step(3, "train")
    s.aggregate(step, [(A, reply(protos([0, 1], 1), 3)), (B, stale)])
    assert s._uploads[0][2].tolist() == [1.0, 1.0, 0.25, 0.25]
    s.server_train(step, ServerContext.for_step(3, 2, "cpu"))
    assert s.aligner is not None
    from coordinator.strategies.fedktl.server import Aligner

    al = Aligner(C, 8, C)
    al.load_state_dict({k: torch.as_tensor(s.aligner.tensors[k]) for k in al.state_dict()})
    al.eval()
    with torch.no_grad():
        qa = al.transformer(torch.as_tensor(protos([0, 1], 1).vectors))
        qb = al.transformer(torch.as_tensor(protos([1, 2], 10).vectors))
    cent = s.aligner.tensors["centroids.weight"]
    expected = (qa[1] + 0.25 * qb[0]) / 1.25
    np.testing.assert_allclose(cent[1], expected.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cent[2], qb[1].numpy(), rtol=1e-5, atol=1e-6)  # alone: its mean


def test_the_squared_error_term_scales_each_prototype_by_its_weight() -> None:
    from coordinator.strategies.fedktl.server import Aligner, _loss

    s = strategy(mmd_weight=0.0)
    al = Aligner(C, 8, C)
    p, y = torch.as_tensor(protos([0, 1, 2], 4).vectors), torch.tensor([0, 1, 2])
    w = torch.tensor([1.5, 1.2, 0.3])  # mean 1
    with torch.no_grad():
        err = (al.transform(p) - al.centroids(y)).pow(2).mean(dim=1)
        terms = _loss(s._ready(), s.config)(al, (p, y, w), torch.Generator().manual_seed(0))
    expected = s.config.mse_weight * (err * w).mean()
    assert terms["loss"].item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize(
    ("p", "field"),
    [
        (protos([0, 1], k=C + 1), "vectors"),  # wrong K
        (protos([3]), "class_ids"),  # a class A did not register
        (PrototypeSet(np.array([0]), np.full((1, C), 0.9), np.array([5])), "vectors"),  # not unit
    ],
)
def test_replies_that_do_not_fit_are_refused(p: PrototypeSet, field: str) -> None:
    with pytest.raises(ValidationError, match=f"reply.payloads.protos.{field}"):
        strategy().validate(Step(1, "train"), A, reply(p))


def test_a_restarted_coordinator_continues_with_f_the_centroids_and_the_generator() -> None:
    # Prepare: two rounds without a restart; one round, a restart from the stored state, one more
    straight = strategy()
    one_round(straight, 1)
    one_round(straight, 2)
    first = strategy()
    one_round(first, 1)
    stored = first.state_dict()

    # Execute
    restarted = strategy()
    restarted.load_state_dict(stored)
    at_restart = restarted.configure(Step(2, "train"), B)
    one_round(restarted, 2)

    # Assert: same holders (no set-up resent), same pairs, and round 2 continues identically
    assert "setup" not in at_restart
    before = first.configure(Step(2, "train"), B)["pairs"]
    assert isinstance(before, ImageVectorPairs)
    np.testing.assert_array_equal(at_restart["pairs"].images, before.images)  # type: ignore[union-attr]
    assert straight.aligner is not None and restarted.aligner is not None
    for name, value in straight.aligner.tensors.items():
        np.testing.assert_array_equal(value, restarted.aligner.tensors[name])
    gen = stored["generator"]
    assert isinstance(gen, TensorMap) and bytes(gen.tensors["sha256"].astype(np.uint8)).hex() == (
        first.generator_id
    )


def test_a_restart_with_another_generator_is_refused() -> None:
    stored = strategy().state_dict()
    other = create_strategy(
        "fedktl", FedKTLConfig.from_dict({**CPPN, "cppn_seed": 1}), num_classes=C, seed=5
    )
    with pytest.raises(ConfigError, match="a resumed run continues with its own generator"):
        other.load_state_dict(stored)


class NaNGenerator(nn.Module):
    """A generator of the module convention whose images are NaN."""

    z_dim = w_dim = 4
    img_channels, img_resolution = 1, 4

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 16)

    def synthesis(self, w: Tensor) -> Tensor:
        return self.lin(w).view(-1, 1, 4, 4) * float("nan")


def nan_generator() -> NaNGenerator:
    return NaNGenerator()


@pytest.mark.parametrize(
    ("hyper", "match"),
    [
        ({"generator": "torchscript"}, "needs generator_path"),
        ({"generator": "torchscript", "generator_path": "/nonexistent/g.pt"}, "no such file"),
        ({"latent_dim": 5}, "w_dim = 8, but the run's latent_dim is 5"),
        (
            {"generator": "entry_point", "generator_entry": f"{__name__}:nan_generator"},
            "NaN or inf",
        ),
        ({"etf_dim": 3}, "K=3 < num_classes C=4"),
    ],
)
def test_a_bad_generator_or_etf_size_is_an_error_before_round_one(
    hyper: dict[str, object], match: str
) -> None:
    cfg = FedKTLConfig.from_dict({**CPPN, **hyper})
    s = create_strategy("fedktl", cfg, num_classes=C, seed=0)
    with pytest.raises(ConfigError, match=match) as info:
        s.plan(3)
    if "generator" in hyper or "latent_dim" in hyper:
        assert isinstance(info.value, GeneratorError)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit is deprecated, still §9.1's
def test_torchscript_generator_file_is_loaded_and_identified(tmp_path: Path) -> None:
    from models.gen_nets import CPPNGenerator
    from models.generators import sha256_file

    path = tmp_path / "g.pt"
    torch.jit.save(torch.jit.script(CPPNGenerator(w_dim=6, img_resolution=8)), str(path))
    s = strategy(generator="torchscript", generator_path=str(path))
    assert s.generator_id == sha256_file(path) and s.config.latent_dim == 6


def test_agents_with_other_channel_counts_are_refused() -> None:
    with pytest.raises(AdmissionError, match="takes 2"):
        strategy().admit(agent("z", [0], (2, 8, 8)), [A])


@pytest.mark.parametrize(
    ("hyper", "only"), [({"mmd_weight": 0.0}, "mse"), ({"mse_weight": 0.0}, "mmd")]
)
def test_ablations_drop_one_server_loss_term(hyper: dict[str, float], only: str) -> None:
    metrics = one_round(strategy(**hyper))
    assert metrics["ktl_loss"] == pytest.approx(metrics[f"ktl_{only}"], rel=1e-5)
    assert metrics["ktl_mmd"] > 0 and metrics["ktl_mse"] > 0  # both still logged
