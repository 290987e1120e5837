"""The one training loop: parameter groups, sub-steps, the after_step hook, divergence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edge_agent.trainer import ParamGroup, TensorData, TrainingError, train_epochs
from models import Classifier, create_model
from protocol.algorithms.baselines import LocalConfig

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
