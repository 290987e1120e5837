"""The one training loop: parameter groups, sub-steps, the after_step hook, divergence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edge_agent.trainer import ParamGroup, TensorData, TrainingError, train_epochs
from models import Classifier, create_model
from protocol.algorithms.local import LocalConfig

CFG = LocalConfig(batch_size=4, lr=0.1, momentum=0.0, grad_clip=0.0, local_epochs=1)


class Hooks:
    """CE, recording what after_step receives."""

    def __init__(self) -> None:
        self.seen: list[tuple[Tensor, Tensor]] = []

    def step_loss(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> Tensor:
        return F.cross_entropy(logits, y)

    def after_step(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> None:
        self.seen.append((features, logits))


def setup() -> tuple[Classifier, TensorData]:
    torch.manual_seed(0)
    net = create_model("mlp_s", num_classes=3, in_chans=1, feature_dim=8, input_size=4)
    data = TensorData(torch.rand(8, 1, 4, 4), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]))
    return net, data


def params(module: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def test_after_step_gets_detached_features_and_logits_of_the_step() -> None:
    net, data = setup()
    hooks = Hooks()
    stats = train_epochs(net, data, CFG, hooks)
    assert stats.steps == len(hooks.seen) == 2
    features, logits = hooks.seen[0]
    assert features.shape == (4, 8) and logits.shape == (4, 3)
    assert not features.requires_grad and not logits.requires_grad


def test_group_settings_override_the_config() -> None:
    # Prepare: the same start twice; lr 0 in the group freezes the weights, the config's moves
    net, data = setup()
    start = params(net)
    # Execute
    train_epochs(net, data, CFG, Hooks(), groups=[ParamGroup("model", net, lr=0.0)])
    # Assert
    assert all(torch.equal(a, b) for a, b in zip(start, params(net), strict=True))
    train_epochs(net, data, CFG, Hooks())
    assert not all(torch.equal(a, b) for a, b in zip(start, params(net), strict=True))


def test_sub_step_trains_its_group_only_and_none_skips_it() -> None:
    # Prepare: a second module trained by a sub-step on its own loss
    net, data = setup()
    extra = nn.Linear(16, 1)
    calls: list[bool] = []

    def extra_loss(x: Tensor, y: Tensor) -> Tensor | None:
        calls.append(net.training)
        if len(calls) == 2:
            return None  # the second batch has nothing to learn
        return extra(x.flatten(1)).pow(2).mean()

    start = params(extra)
    updates: list[list[Tensor]] = []
    sub = ParamGroup(
        "extra", extra, loss=extra_loss, lr=0.5, after_update=lambda: updates.append(params(extra))
    )
    # Execute
    train_epochs(net, data, CFG, Hooks(), groups=[ParamGroup("model", net), sub])
    # Assert: called per batch with the main model in eval mode; updated once (batch 2 skipped)
    assert calls == [False, False]
    assert len(updates) == 1
    assert all(torch.equal(a, b) for a, b in zip(updates[0], params(extra), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(start, params(extra), strict=True))


def test_a_frozen_tensor_stays_frozen() -> None:
    net, data = setup()
    frozen = next(net.parameters())
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    extra = nn.Linear(16, 1)
    sub = ParamGroup("extra", extra, loss=lambda x, y: extra(x.flatten(1)).mean())
    train_epochs(net, data, CFG, Hooks(), groups=[ParamGroup("model", net), sub])
    assert torch.equal(before, frozen) and not frozen.requires_grad


def test_a_non_finite_loss_is_an_error_naming_the_step() -> None:
    net, data = setup()

    class Diverges(Hooks):
        def step_loss(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> Tensor:
            return logits.sum() * float("nan")

    with pytest.raises(TrainingError, match=r"step 1/2"):
        train_epochs(net, data, CFG, Diverges())
    assert all(p.requires_grad for p in net.parameters())


def test_groups_with_one_loss_share_a_sub_step_and_are_clipped_apart() -> None:
    # Prepare: a sub-step loss on two tensors, one with a gradient 1000x the other's
    net, data = setup()
    big = torch.ones(4, requires_grad=True)
    small = torch.ones(4, requires_grad=True)
    calls: list[tuple[bool, bool]] = []

    def joint_loss(x: Tensor, y: Tensor) -> Tensor:
        calls.append((big.requires_grad, small.requires_grad))
        return 1000.0 * big.sum() + small.sum()

    owner = nn.Module()
    subs = [
        ParamGroup(name, owner, params=[t], loss=joint_loss, lr=1.0, grad_clip=10.0)
        for name, t in (("big", big), ("small", small))
    ]
    # Execute: one batch
    one_batch = TensorData(data.x[:4], data.y[:4])
    train_epochs(net, one_batch, CFG, Hooks(), groups=[ParamGroup("model", net), *subs])
    # Assert: one evaluation with both tensors free; each clipped by its own norm: big's
    # gradient (norm 2000) to norm 10, small's (norm 2) untouched. A joint clip would have
    # scaled both by 10/2000.
    assert calls == [(True, True)]
    assert torch.allclose(big.detach(), torch.full((4,), 1.0 - 10.0 / 2.0))
    assert torch.allclose(small.detach(), torch.zeros(4))


def test_a_frozen_group_in_train_mode_keeps_batch_statistics_and_its_weights() -> None:
    # Prepare: a BatchNorm sub-step module whose output feeds the main step's loss
    net, data = setup()
    bn = nn.BatchNorm1d(3)
    modes: list[bool] = []

    class ThroughBN(Hooks):
        def step_loss(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> Tensor:
            modes.append(bn.training)
            return F.cross_entropy(bn(logits), y)

    sub = ParamGroup("bn", bn, loss=lambda x, y: None, frozen_mode="train")
    weights = params(bn)
    # Execute
    train_epochs(net, data, CFG, ThroughBN(), groups=[ParamGroup("model", net), sub])
    # Assert: the main step ran the frozen module in train mode (its running statistics moved
    # from their init), and its parameters did not move
    assert modes == [True, True]
    assert not torch.equal(bn.running_mean, torch.zeros(3))
    assert all(torch.equal(a, b) for a, b in zip(weights, params(bn), strict=True))
    assert all(p.requires_grad for p in bn.parameters())


def test_on_epoch_runs_before_each_epoch_after_the_previous_updates() -> None:
    # Prepare: record, at each epoch start, the epoch and how many steps were already taken
    net, data = setup()
    hooks = Hooks()
    starts: list[tuple[int, int]] = []
    # Execute: 3 epochs of 2 batches
    train_epochs(
        net, data, CFG, hooks, epochs=3, on_epoch=lambda e: starts.append((e, len(hooks.seen)))
    )
    # Assert
    assert starts == [(0, 0), (1, 2), (2, 4)]


def test_on_epoch_is_not_called_for_zero_epochs() -> None:
    net, data = setup()
    starts: list[int] = []
    train_epochs(net, data, CFG, Hooks(), epochs=0, on_epoch=starts.append)
    assert starts == []


class Order(Hooks):
    """Records the labels of every batch, which identify the samples (labels are 0..n-1)."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[int]] = []

    def after_step(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> None:
        self.batches.append(y.tolist())


def _numbered(n: int) -> tuple[Classifier, TensorData]:
    torch.manual_seed(0)
    net = create_model("mlp_s", num_classes=n, in_chans=1, feature_dim=8, input_size=4)
    return net, TensorData(torch.rand(n, 1, 4, 4), torch.arange(n))


def test_the_fixed_order_repeats_every_epoch_and_call_and_drop_last_skips_the_tail() -> None:
    # HtFLlib's loader: one order for every epoch and round, no partial batch
    net, data = _numbered(25)
    fixed = LocalConfig(batch_size=10, lr=0.01, local_epochs=2, batch_order="fixed", drop_last=True)
    first, second, other = Order(), Order(), Order()
    agent = torch.Generator().manual_seed(1)  # one agent: its generator advances between calls
    stats = train_epochs(net, data, fixed, first, generator=agent)
    torch.rand(3, generator=agent)
    train_epochs(net, data, fixed, second, generator=agent)
    train_epochs(net, data, fixed, other, generator=torch.Generator().manual_seed(2))
    assert stats.steps == 4 and stats.samples == 40  # 2 epochs x 2 full batches of 10
    assert first.batches[:2] == first.batches[2:] == second.batches[:2]
    assert sorted(first.batches[0] + first.batches[1]) != list(range(20))  # shuffled once
    assert other.batches[:2] != first.batches[:2]  # another seed, another order
    # the default draws a new order each epoch and keeps the partial batch
    shuffled = Order()
    stats = train_epochs(
        net,
        data,
        LocalConfig(batch_size=10, lr=0.01, local_epochs=2),
        shuffled,
        generator=torch.Generator().manual_seed(1),
    )
    assert stats.steps == 6 and stats.samples == 50
    assert [len(b) for b in shuffled.batches] == [10, 10, 5, 10, 10, 5]
    assert shuffled.batches[:3] != shuffled.batches[3:]


def test_drop_last_with_fewer_samples_than_a_batch_trains_nothing() -> None:
    net, data = _numbered(6)
    before = params(net)
    stats = train_epochs(net, data, LocalConfig(batch_size=10, lr=0.1, drop_last=True), Order())
    assert (stats.steps, stats.samples) == (0, 0)
    assert all(torch.equal(a, b) for a, b in zip(before, params(net), strict=True))


def test_a_last_batch_of_one_sample_is_left_out_when_the_epoch_has_others() -> None:
    # Prepare: 21 samples in batches of 10 leave one; 11 in 10 too; 1 in 10 is the only batch
    net, data = _numbered(21)
    # Execute / Assert
    order = Order()
    stats = train_epochs(net, data, LocalConfig(batch_size=10, lr=0.01), order)
    assert [len(b) for b in order.batches] == [10, 10]
    assert (stats.steps, stats.samples) == (2, 20)
    net, data = _numbered(1)
    stats = train_epochs(net, data, LocalConfig(batch_size=10, lr=0.01), Order())
    assert (stats.steps, stats.samples) == (1, 1)
    net, data = _numbered(12)  # a last batch of two is kept
    stats = train_epochs(net, data, LocalConfig(batch_size=10, lr=0.01), Order())
    assert (stats.steps, stats.samples) == (2, 12)


def test_a_batchnorm_model_trains_on_a_split_leaving_one_sample_over() -> None:
    # ResNet-18 at 8x8 pools to 1x1 before its last BatchNorm: one sample has one value per
    # channel there, and BatchNorm refuses it in train mode (FedType's default proxy)
    torch.manual_seed(0)
    net = create_model("resnet18", num_classes=3, in_chans=1, feature_dim=8, input_size=8)
    data = TensorData(torch.rand(9, 1, 8, 8), torch.arange(9) % 3)
    stats = train_epochs(net, data, CFG, Hooks())
    assert (stats.steps, stats.samples) == (2, 8)
