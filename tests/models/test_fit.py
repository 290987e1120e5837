"""The one server-side fit loop: it trains, it replays exactly, it refuses bad input."""

import pytest
import torch
from torch import Tensor, nn

from models.fit import FitError, fit, resumed, row_weights, with_row_weights
from models.tensormap import module_to_tensormap
from protocol.errors import ValidationError


def mse(module: nn.Module, batch: tuple[Tensor, ...], gen: torch.Generator) -> dict[str, Tensor]:
    x, y = batch
    noise = torch.randn(y.shape, generator=gen) * 1e-3  # the generator also drives noise
    err = nn.functional.mse_loss(module(x) + noise, y)
    return {"loss": err, "mse": err}


def problem() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def trained(seed: int) -> tuple[nn.Linear, float]:
    torch.manual_seed(1)
    model = nn.Linear(4, 1)
    stats = fit(
        model,
        problem(),
        mse,
        epochs=30,
        batch_size=32,
        lr=0.05,
        generator=torch.Generator().manual_seed(seed),
    )
    return model, stats.terms["mse"]


def test_fit_learns_a_linear_map() -> None:
    model, last = trained(0)
    assert last < 1e-2
    assert torch.allclose(model.weight, torch.tensor([[1.0, -2.0, 0.5, 3.0]]), atol=0.05)


def test_same_generator_replays_exactly_another_does_not() -> None:
    a, _ = trained(0)
    b, _ = trained(0)
    c, _ = trained(1)
    assert torch.equal(a.weight, b.weight)
    assert not torch.equal(a.weight, c.weight)


def test_diverging_loss_is_an_error() -> None:
    def nan_loss(module: nn.Module, batch: tuple[Tensor, ...], gen: torch.Generator):
        return {"loss": module(batch[0]).sum() * float("nan")}

    with pytest.raises(FitError, match="loss became nan"):
        fit(
            nn.Linear(4, 1),
            problem(),
            nan_loss,
            epochs=1,
            batch_size=8,
            lr=0.1,
            generator=torch.Generator(),
        )


def test_tensors_of_different_lengths_are_refused() -> None:
    x, y = problem()
    with pytest.raises(FitError, match="first dimension"):
        fit(
            nn.Linear(4, 1),
            (x, y[:10]),
            mse,
            epochs=1,
            batch_size=8,
            lr=0.1,
            generator=torch.Generator(),
        )


def test_a_trailing_single_sample_batch_is_skipped_with_batchnorm() -> None:
    # 33 samples in batches of 8: the last batch has one sample, which BatchNorm refuses
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
    x, y = problem()
    stats = fit(
        net,
        (x[:33], y[:33]),
        mse,
        epochs=2,
        batch_size=8,
        lr=0.01,
        generator=torch.Generator().manual_seed(0),
    )
    assert stats.steps == 8 and stats.samples == 64


def test_row_weights_are_normalised_to_mean_one_and_absent_when_all_alike() -> None:
    w = row_weights([1.0, 0.25])
    assert w is not None and w.tolist() == pytest.approx([1.6, 0.4])
    assert row_weights([0.5, 0.5, 0.5]) is None  # all alike: the plain mean
    assert row_weights(None) is None and row_weights([]) is None


def test_with_row_weights_appends_them_only_when_they_differ() -> None:
    x, y = torch.zeros(2, 3), torch.tensor([0, 1])
    assert with_row_weights((x, y), [1.0, 1.0]) == (x, y)
    weighted = with_row_weights((x, y), [1.0, 3.0])
    assert len(weighted) == 3 and weighted[2].tolist() == pytest.approx([0.5, 1.5])


def test_resumed_seeds_the_first_step_and_continues_from_state() -> None:
    def build() -> nn.Linear:
        return nn.Linear(4, 2)

    first = resumed(build, None, torch.Generator().manual_seed(7), "head")
    again = resumed(build, None, torch.Generator().manual_seed(7), "head")
    other = resumed(build, None, torch.Generator().manual_seed(8), "head")
    assert torch.equal(first.weight, again.weight)  # the step's generator decides the start
    assert not torch.equal(first.weight, other.weight)
    with torch.no_grad():
        first.weight.add_(1.0)  # trained in between
    state = module_to_tensormap(first)
    later = resumed(build, state, torch.Generator().manual_seed(8), "head")
    assert torch.equal(later.weight, first.weight)  # the state wins over the generator
    with pytest.raises(ValidationError, match="head"):
        resumed(lambda: nn.Linear(5, 2), state, torch.Generator(), "head")
