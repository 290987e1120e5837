"""FedVTC's generator: Table 6 shapes and widths, the C0·(H/4)·(W/4) = p rule, averaging."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models import VTCGenerator, vtc_for, vtc_widths
from protocol.errors import ConfigError

# (p, chans, size, latent shape, widths): the paper's three configs and the 8×8 toy one.
CONFIGS = [
    (980, 1, 28, (20, 7, 7), (16, 32)),
    (4096, 3, 32, (64, 8, 8), (32, 64)),
    (32768, 3, 64, (128, 16, 16), (64, 64)),
    (64, 1, 8, (16, 2, 2), (16, 32)),
]


@pytest.mark.parametrize(("p", "chans", "size", "latent", "widths"), CONFIGS)
def test_configs_shapes_and_widths(
    p: int, chans: int, size: int, latent: tuple[int, int, int], widths: tuple[int, int]
) -> None:
    # Prepare
    gen = vtc_for(p, chans, size)

    # Execute
    images = gen(torch.randn(2, p))

    # Assert
    assert gen.latent_shape == latent and gen.widths == widths
    assert images.shape == (2, chans, size, size)
    assert ((images > 0) & (images < 1)).all()
    convs = [m for m in gen.modules() if isinstance(m, nn.ConvTranspose2d)]
    assert [c.out_channels for c in convs] == [widths[0], widths[1], widths[1], chans]
    assert [c.kernel_size[0] for c in convs] == [3, 4, 3, 4]
    assert all(c.bias is not None for c in convs)


def test_block_order_conv_bn_activation() -> None:
    gen = vtc_for(980, 1, 28)
    kinds = [[type(m) for m in block.children()] for block in gen.blocks.children()]
    act = [nn.LeakyReLU] * 3 + [nn.Sigmoid]
    assert kinds == [[nn.ConvTranspose2d, nn.BatchNorm2d, a] for a in act]
    first_act = gen.get_submodule("blocks.0.2")
    assert isinstance(first_act, nn.LeakyReLU) and first_act.negative_slope == 0.01


def test_mnist_generator_is_about_21k_parameters() -> None:
    count = sum(p.numel() for p in vtc_for(980, 1, 28).parameters())
    assert 20_000 < count < 22_000


def test_widths_rule_reproduces_table() -> None:
    assert [vtc_widths(c0) for c0 in (20, 64, 128, 16)] == [(16, 32), (32, 64), (64, 64), (16, 32)]


def test_rectangular_output_and_explicit_widths() -> None:
    gen = VTCGenerator(3 * 2 * 4, 3, (8, 16), widths=(8, 8))
    assert gen(torch.randn(2, 24)).shape == (2, 3, 8, 16)


@pytest.mark.parametrize(
    ("p", "size"), [(981, 28), (980, 30), (0, 8)], ids=["p-not-multiple", "size-not-4", "p-zero"]
)
def test_invalid_configs_raise(p: int, size: int) -> None:
    with pytest.raises(ConfigError):
        vtc_for(p, 1, size)


def test_state_dicts_average_like_weights() -> None:
    """fedvtc.md §8-D11: identical keys; averaged weights and BN buffers load and run."""
    # Prepare
    gens = [vtc_for(64, 1, 8) for _ in range(3)]
    for gen in gens:  # move BN running statistics away from their initial values
        gen(torch.randn(4, 64))
    states = [g.state_dict() for g in gens]

    # Execute
    averaged = {
        key: (
            torch.stack([s[key].float() for s in states]).mean(0).to(states[0][key].dtype)
            if states[0][key].is_floating_point()
            else states[0][key]
        )
        for key in states[0]
    }
    target = vtc_for(64, 1, 8)
    target.load_state_dict(averaged, strict=True)

    # Assert
    assert all(s.keys() == states[0].keys() for s in states)
    assert any(k.endswith("running_mean") for k in averaged)
    torch.testing.assert_close(
        target.state_dict()["blocks.0.1.running_mean"],
        torch.stack([s["blocks.0.1.running_mean"] for s in states]).mean(0),
    )
    assert torch.isfinite(target.eval()(torch.randn(2, 64))).all()
