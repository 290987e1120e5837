"""Pretrained-generator interface: bundled generators, the three loaders, validation."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from models import generators as G
from models.gen_nets import CPPNGenerator, DCGANGenerator


def _rng(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_cppn_is_small_deterministic_and_in_unit_range() -> None:
    # Prepare
    gen = G.bundled("cppn", w_dim=16, img_channels=3, img_resolution=8, seed=1)
    again = G.bundled("cppn", w_dim=16, img_channels=3, img_resolution=8, seed=1)

    # Execute
    w = gen.sample_w(4, _rng())
    images = gen.synthesize(w)

    # Assert
    assert w.shape == (4, 16) and images.shape == (4, 3, 8, 8)
    assert float(images.min()) >= 0.0 and float(images.max()) <= 1.0
    assert float(images.std()) > 0.01  # not a constant image
    torch.testing.assert_close(again.synthesize(again.sample_w(4, _rng())), images)
    assert gen.module is not None and sum(p.numel() for p in gen.module.parameters()) < 10_000


def test_unknown_bundled_name() -> None:
    with pytest.raises(G.GeneratorError, match="cppn"):
        G.bundled("stylegan")


def test_torchscript_round_trip(tmp_path: Path) -> None:
    # Prepare
    module = CPPNGenerator(w_dim=8, img_channels=1, img_resolution=8, seed=2)
    path = tmp_path / "gen.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.script is deprecated
        torch.jit.script(module).save(str(path))  # type: ignore[no-untyped-call]

    # Execute
    gen = G.load_torchscript(path)

    # Assert
    w = gen.sample_w(2, _rng())
    torch.testing.assert_close(gen.synthesize(w), (module.synthesis(w) + 1) / 2)
    assert gen.files == {str(path): G.sha256_file(path)}


def test_onnx_round_trip(tmp_path: Path) -> None:
    # Prepare
    module = CPPNGenerator(w_dim=8, img_channels=3, img_resolution=8, seed=3)
    manifest = G.save_onnx_generator(module, tmp_path)

    # Execute
    gen = G.load_onnx(manifest)

    # Assert
    w = gen.sample_w(3, _rng())
    torch.testing.assert_close(gen.synthesize(w), (module.synthesis(w) + 1) / 2, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        w, module.mapping(torch.randn(3, 8, generator=_rng())), atol=1e-5, rtol=0
    )
    assert set(gen.files) == {
        str(tmp_path / n) for n in ("generator.json", "synthesis.onnx", "mapping.onnx")
    }


def test_onnx_manifest_errors(tmp_path: Path) -> None:
    bad = tmp_path / "g.json"
    bad.write_text("{not json")
    with pytest.raises(G.GeneratorError, match="JSON"):
        G.load_onnx(bad)
    bad.write_text(json.dumps({"z_dim": 1, "w_dim": 1, "img_channels": 1, "img_resolution": 8}))
    with pytest.raises(G.GeneratorError, match="synthesis"):
        G.load_onnx(bad)
    with pytest.raises(G.GeneratorError, match="no such file"):
        G.load_onnx(tmp_path / "missing.json")


def test_entry_point_with_weights_only_state_dict(tmp_path: Path) -> None:
    # Prepare
    source = CPPNGenerator(w_dim=4, img_channels=1, img_resolution=8, seed=5)
    weights = tmp_path / "w.pt"
    torch.save({"netG": source.state_dict()}, weights)

    # Execute: seed 9 differs, so equality proves the weights were loaded
    gen = G.load_entry_point(
        "models.gen_nets:CPPNGenerator",
        weights,
        kwargs={"w_dim": 4, "img_channels": 1, "img_resolution": 8, "seed": 9},
        state_key="netG",
    )

    # Assert
    w = torch.randn(2, 4)
    torch.testing.assert_close(gen.synthesize(w), (source.synthesis(w) + 1) / 2)
    assert gen.files[str(weights)] == G.sha256_file(weights)


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ("os.system", "pkg.module:callable"),
        ("no_such_pkg:f", "cannot be resolved"),
        ("torch:zeros", "not an nn.Module"),
    ],
)
def test_entry_point_errors(entry: str, match: str) -> None:
    with pytest.raises(G.GeneratorError, match=match):
        G.load_entry_point(entry, kwargs={"size": (1,)} if entry == "torch:zeros" else None)


def test_entry_point_rejects_pickled_objects(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"model": nn.Linear(2, 2)}, path)  # a pickled module, not a state dict
    with pytest.raises(G.GeneratorError, match="weights-only"):
        G.load_entry_point("models.gen_nets:CPPNGenerator", path)


class _WrongRange(nn.Module):
    z_dim, w_dim, img_channels, img_resolution = 2, 2, 1, 4
    output_range = (-1.0, 1.0)

    def synthesis(self, w: torch.Tensor) -> torch.Tensor:
        return torch.full((w.shape[0], 1, 4, 4), 255.0)


class _WrongShape(_WrongRange):
    def synthesis(self, w: torch.Tensor) -> torch.Tensor:
        return torch.zeros(w.shape[0], 1, 5, 5)


class _NaN(_WrongRange):
    def synthesis(self, w: torch.Tensor) -> torch.Tensor:
        return torch.full((w.shape[0], 1, 4, 4), float("nan"))


@pytest.mark.parametrize(
    ("cls", "match"), [(_WrongRange, "output_range"), (_WrongShape, "expected"), (_NaN, "NaN")]
)
def test_validation_rejects_bad_generators(cls: type[nn.Module], match: str) -> None:
    with pytest.raises(G.GeneratorError, match=match):
        G.load_entry_point(f"{__name__}:{cls.__name__}")


def test_adapt_images_resizes_crops_and_greys() -> None:
    rgb = torch.rand(2, 3, 64, 64)
    grey = G.adapt_images(rgb, 1, 28)
    assert grey.shape == (2, 1, 28, 28) and float(grey.min()) >= 0 and float(grey.max()) <= 1
    assert G.adapt_images(torch.rand(1, 1, 8, 8), 3, (16, 12)).shape == (1, 3, 16, 12)
    flat = G.adapt_images(torch.ones(1, 3, 8, 8) * torch.tensor([1.0, 0, 0]).view(1, 3, 1, 1), 1, 8)
    torch.testing.assert_close(flat, torch.full((1, 1, 8, 8), 0.299))


def test_dcgan_face_from_wheel() -> None:
    pytest.importorskip("gan_face_generate")
    gen = G.bundled("dcgan_face")
    images = gen.synthesize(gen.sample_w(2, _rng()))
    assert (gen.z_dim, gen.w_dim, gen.img_channels, gen.img_resolution) == (100, 100, 3, 64)
    assert images.shape == (2, 3, 64, 64)
    assert float(images.std()) > 0.05  # trained weights, not a flat image
    assert len(next(iter(gen.files.values()))) == 64
    assert gen.module is not None and sum(p.numel() for p in gen.module.parameters()) > 3_000_000


def test_dcgan_face_layout_matches_checkpoint_keys() -> None:
    keys = set(DCGANGenerator().state_dict())
    assert {"main.0.weight", "main.1.running_var", "main.12.weight"} <= keys
    assert "main.12.bias" not in keys
