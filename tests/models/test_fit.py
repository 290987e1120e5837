"""The one server-side fit loop: it trains, it replays exactly, it refuses bad input."""

import pytest
import torch
from torch import Tensor, nn

from models.fit import FitError, fit, row_weights


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
