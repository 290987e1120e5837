"""edge-export: exit codes, one-line errors, summary, and a torch-free --help."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from export_helpers import images
from torch import nn

import models._registry
from export.cli import main
from models import Classifier


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edge-export: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_help_does_not_import_torch() -> None:
    code = (
        "import sys, export.cli as c\n"
        "try:\n    c.main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "heavy = [m for m in ('torch', 'onnx', 'onnxruntime', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        cwd=Path(__file__).parents[2],
    )
    assert proc.returncode == 0, proc.stderr
    for fragment in ("--int8 [{static,dynamic}]", "--exporter {dynamo,legacy}", "--calibration"):
        assert fragment in proc.stdout


def test_success_writes_bundle_and_summary(
    checkpoint: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "d.npz"
    x = (images(40) * 255).astype(np.uint8)  # uint8 pixels are scaled to [0, 1]
    np.savez(data, x=x[:, 0], y=np.arange(40) % 10)  # [N, H, W]: channel axis added
    code, out, err = _run(
        capsys,
        str(checkpoint()),
        "-o",
        str(tmp_path / "b"),
        "--fp16",
        "--int8",
        "static",
        "--data",
        str(data),
        "--exporter",
        "legacy",
        "--providers",
        "CUDAExecutionProvider,CPUExecutionProvider",
    )
    assert code == 0, err
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert [f["file"] for f in manifest["files"]] == [
        "model.onnx",
        "model.fp16.onnx",
        "model.int8.onnx",
    ]
    assert manifest["verification_inputs"] == "real" and manifest["num_samples"] == 40
    assert manifest["export"]["exporter"] == "legacy"
    assert manifest["providers_requested"] == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert "model.int8.onnx" in out and "acc " in out and "verification inputs: real" in out


def test_bare_int8_is_static_calibrated_on_calibration_file(
    checkpoint: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    test, calib = tmp_path / "test.npz", tmp_path / "train.npz"
    np.savez(test, x=images(20), y=np.arange(20) % 10)
    np.savez(calib, x=images(50, seed=1))  # no labels needed for calibration
    code, _, err = _run(
        capsys,
        str(checkpoint()),
        "-o",
        str(tmp_path / "b"),
        "--data",
        str(test),
        "--calibration",
        str(calib),
        "--int8",
        "--int8",
        "dynamic",
        "--exporter",
        "legacy",
    )
    assert code == 0, err
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    files = {f["variant"]: f for f in manifest["files"]}
    assert list(files) == ["fp32", "int8-static", "int8-dynamic"]
    for rec in files.values():  # every variant: size, accuracy next to fp32, latency
        assert rec["size_bytes"] > 0 and rec["latency_ms_b1"] > 0
        assert rec["accuracy"] is not None
    assert files["fp32"]["accuracy_drop"] is None
    assert files["int8-static"]["accuracy_drop"] is not None
    assert manifest["calibration"]["source"] == "calibration"
    assert manifest["calibration"]["num_samples"] == 50
    umask = os.umask(0o022)
    os.umask(umask)
    for name in files:  # like any file written here, not mkstemp's 0600
        mode = (tmp_path / "b" / files[name]["file"]).stat().st_mode & 0o777
        assert mode == 0o666 & ~umask, oct(mode)


def test_missing_calibration_file(
    checkpoint: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(
        capsys,
        str(checkpoint()),
        "-o",
        str(tmp_path / "b"),
        "--int8",
        "--calibration",
        "absent.npz",
    )
    assert code == 2
    _one_error_line(err, "--calibration: npz dataset absent.npz not found")


def test_missing_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, str(tmp_path / "nope.pt"), "-o", str(tmp_path / "b"))
    assert code == 2
    _one_error_line(err, "checkpoint not found", "nope.pt")


def test_corrupt_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\x00garbage" * 50)
    code, _, err = _run(capsys, str(bad), "-o", str(tmp_path / "b"))
    assert code == 2
    _one_error_line(err, "bad.pt", "not a torch.save archive")


def test_truncated_checkpoint(
    checkpoint: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = checkpoint()
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    code, _, err = _run(capsys, str(path), "-o", str(tmp_path / "b"))
    assert code == 2
    _one_error_line(err, path.name, "not a torch.save archive")


@pytest.mark.parametrize(
    ("edit", "fragments"),
    [
        (
            lambda raw: raw["model"].update(name="cnn_t1"),  # another family: other layer names
            ("state_dict does not match cnn_t1", "missing", "unexpected"),
        ),
        (
            lambda raw: raw["model"].update(name="no_such_net"),
            ("checkpoint model 'no_such_net' cannot be built",),
        ),
        (
            lambda raw: raw["model"].update(num_classes=7),
            ("state_dict does not match mlp_s", "[10, 64] vs model [7, 64]"),
        ),
    ],
    ids=["other-family", "unknown-name", "other-num-classes"],
)
def test_checkpoint_not_matching_its_architecture(
    checkpoint: Callable[..., Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    edit: Callable[[dict[str, Any]], None],
    fragments: tuple[str, ...],
) -> None:
    path = checkpoint()
    raw = torch.load(path, weights_only=True)
    edit(raw)
    torch.save(raw, path)
    code, _, err = _run(capsys, str(path), "-o", str(tmp_path / "b"))
    assert code == 2
    _one_error_line(err, *fragments)
    assert not (tmp_path / "b" / "model.onnx").exists()


def test_architecture_mismatch(
    checkpoint: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = checkpoint()
    raw = torch.load(path, weights_only=True)
    raw["model"]["name"] = "mlp_m"  # same layer names, other widths
    torch.save(raw, path)
    code, _, err = _run(capsys, str(path), "-o", str(tmp_path / "b"))
    assert code == 2
    _one_error_line(
        err,
        "state_dict does not match mlp_m",
        "shape-mismatched",
        "trunk.1.weight: checkpoint [64, 64] vs model [128, 64]",
    )


class _Bessel(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.special.bessel_j0(x.flatten(1))
        return out


def test_unsupported_op(
    checkpoint: Callable[..., Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = checkpoint("mlp_s")
    odd = Classifier(_Bessel(), 64, num_classes=10, in_chans=1, input_size=(8, 8))
    odd.model_name = "mlp_s"
    raw = torch.load(path, weights_only=True)
    raw["state_dict"] = odd.state_dict()
    torch.save(raw, path)

    def fake_create(name: str, **kw: Any) -> Classifier:
        return odd

    monkeypatch.setattr(models._registry, "create_model", fake_create)
    code, out, err = _run(capsys, str(path), "-o", str(tmp_path / "b"), "--exporter", "legacy")
    assert code == 2
    _one_error_line(err, "cannot export mlp_s", "aten::special_bessel_j0")
    assert out == ""  # the legacy exporter's IR dump does not reach the user


def test_export_not_matching_pytorch_exits_3(
    checkpoint: Callable[..., Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import export.bundle
    from export.heads import with_head

    def shifted_reference(model: Classifier, head: Any) -> Any:
        other = copy.deepcopy(model)
        with torch.no_grad():
            other.get_classifier().bias.add_(0.1)  # what a wrongly exported weight looks like
        return with_head(other, head)

    monkeypatch.setattr(export.bundle, "with_head", shifted_reference)
    code, _, err = _run(
        capsys, str(checkpoint()), "-o", str(tmp_path / "b"), "--exporter", "legacy"
    )
    assert code == 3
    _one_error_line(err, "ONNX does not match PyTorch on 64 random samples", "max |score diff|")


@pytest.mark.parametrize(
    ("arrays", "fragment"),
    [
        ({"images": np.zeros((2, 1, 8, 8))}, "missing ['x', 'y'], unexpected ['images']"),
        ({"x": np.full((2, 1, 8, 8), 3.0, np.float32)}, "float x must lie in [0, 1]"),
        ({"x": np.zeros((2, 3, 8, 8), np.float32)}, "expected shape [N, 1, 8, 8]"),
    ],
)
def test_bad_data_file(
    checkpoint: Callable[..., Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    arrays: dict[str, np.ndarray],
    fragment: str,
) -> None:
    data = tmp_path / "d.npz"
    np.savez(data, **arrays)  # type: ignore[arg-type]
    code, _, err = _run(capsys, str(checkpoint()), "-o", str(tmp_path / "b"), "--data", str(data))
    assert code == 2
    _one_error_line(err, fragment)


def test_missing_data_file_and_bad_provider(
    checkpoint: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = str(checkpoint())
    code, _, err = _run(capsys, ckpt, "-o", str(tmp_path / "b"), "--data", "absent.npz")
    assert code == 2
    _one_error_line(err, "--data: npz dataset absent.npz not found")
    code, _, err = _run(
        capsys,
        ckpt,
        "-o",
        str(tmp_path / "b"),
        "--providers",
        "TypoProvider",
        "--exporter",
        "legacy",
    )
    assert code == 2
    _one_error_line(err, "unknown execution provider(s) ['TypoProvider']")


def _cut_npz(tmp_path: Path) -> Path:
    path = tmp_path / "cut.npz"
    np.savez(path, x=images(20), y=np.arange(20) % 10)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def _noise(tmp_path: Path) -> Path:
    path = tmp_path / "noise.npz"
    path.write_bytes(np.random.default_rng(0).bytes(2000))
    return path


@pytest.mark.parametrize(
    ("make", "fragments"),
    [
        (_cut_npz, ("--data: npz dataset", "cut.npz", "truncated or corrupt .npz")),
        (_noise, ("noise.npz", "not an .npz archive")),
        (lambda tmp: tmp / "absent_dir/", ("absent_dir", "does not exist")),
    ],
    ids=["truncated", "random-bytes", "missing-directory"],
)
def test_unreadable_data_is_one_line_exit_2(
    checkpoint: Callable[..., Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    make: Callable[[Path], Path],
    fragments: tuple[str, ...],
) -> None:
    data = str(make(tmp_path))
    code, _, err = _run(capsys, str(checkpoint()), "-o", str(tmp_path / "b"), "--data", data)
    assert code == 2
    _one_error_line(err, *fragments)
    assert not (tmp_path / "b").exists()  # refused before exporting anything


def _image_folder(root: Path, n: int = 12) -> Path:
    image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(0)
    for i in range(n):
        folder = root / f"class{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8), "L").save(folder / f"{i}.png")
    return root


def test_data_takes_the_agents_sources(
    checkpoint: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = str(checkpoint())
    # a registry name, exactly as edge-agent --data takes it (1797 labelled 8x8 digits)
    code, _, err = _run(
        capsys, ckpt, "-o", str(tmp_path / "named"), "--data", "digits", "--exporter", "legacy"
    )
    assert code == 0, err
    manifest = json.loads((tmp_path / "named" / "manifest.json").read_text())
    assert manifest["num_samples"] == 1797 and manifest["files"][0]["accuracy"] is not None
    # an image-folder directory, for samples and calibration, resized like the agent's images
    folder = _image_folder(tmp_path / "imgs")
    code, _, err = _run(
        capsys,
        ckpt,
        "-o",
        str(tmp_path / "dir"),
        "--data",
        str(folder),
        "--calibration",
        f"imagefolder:{folder}",
        "--image-size",
        "8",
        "--int8",
        "--exporter",
        "legacy",
    )
    assert code == 0, err
    manifest = json.loads((tmp_path / "dir" / "manifest.json").read_text())
    assert manifest["num_samples"] == 12 and manifest["verification_inputs"] == "real"
    assert manifest["calibration"] == {**manifest["calibration"], "num_samples": 12}


def test_summary_prints_the_manifests_accuracy_drop_with_its_sign(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from export.bundle import Manifest, VariantRecord
    from export.cli import _print_summary

    def record(variant: str, acc: float, drop: float | None) -> VariantRecord:
        return VariantRecord(variant, f"{variant}.onnx", "0", 1000, None, acc, drop, 0.01, ["CPU"])

    manifest = Manifest(
        path=Path("b/manifest.json"),
        source={},
        model={},
        export={},
        verification_inputs="real",
        num_samples=10,
        providers_requested=["CPU"],
        files=[
            record("fp32", 0.9, None),
            record("int8-static", 0.875, 2.5),
            record("fp16", 0.91, -1.0),
        ],
        calibration={},
        metadata={},
        metrics={},
    )
    _print_summary(manifest)
    lines = capsys.readouterr().out.splitlines()
    # accuracy_drop > 0 is lost accuracy in the manifest; the CLI says "drop" with that sign
    assert "acc 87.5% (drop +2.5 pt)" in lines[2]
    assert "acc 91.0% (drop -1.0 pt)" in lines[3]
    assert "drop" not in lines[1]
