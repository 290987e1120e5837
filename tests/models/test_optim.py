"""Adam for both training loops: the fused kernel where torch has one, the loop elsewhere."""

import pytest
import torch
from torch import nn

from models.optim import adam


def fit_line(model: nn.Linear, opt: torch.optim.Optimizer) -> float:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    for _ in range(300):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


@pytest.mark.skipif(TORCH < (2, 4), reason="torch's fused Adam reaches the CPU in 2.4")
def test_adam_is_fused_on_the_cpu_and_trains() -> None:
    model = nn.Linear(4, 1)
    opt = adam(model.parameters(), 0.05, weight_decay=0.0)
    assert opt.defaults["fused"] is True  # torch >= 2.4 has the kernel for the CPU
    assert fit_line(model, opt) < 1e-3


def test_without_a_fused_kernel_adam_takes_the_loop_and_keeps_its_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = torch.optim.Adam

    def no_fused_kernel(*args: object, fused: bool | None = None, **kwargs: object) -> object:
        if fused:
            raise RuntimeError("`fused=True` requires all the params to be on a supported device")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.optim, "Adam", no_fused_kernel)
    model = nn.Linear(4, 1)
    opt = adam(model.parameters(), 0.05, weight_decay=1e-4)  # a generator, consumed once
    assert not opt.defaults["fused"]
    assert opt.defaults["weight_decay"] == 1e-4
    assert len(opt.param_groups[0]["params"]) == 2
    assert fit_line(model, opt) < 1e-3
