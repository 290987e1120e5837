"""export_bundle: files, manifest, variants (fp16, int8 static/dynamic), random-input mode."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from export_helpers import CLASS_NAMES, images

from export import export_bundle, read_metadata
from export.runtime import make_session, run_batches
from models.checkpoint import file_sha256
from protocol.errors import ExportError

ALL_VARIANTS = ("fp32", "fp16", "int8-static", "int8-dynamic")


def test_bundle_with_all_variants(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    ckpt = checkpoint("mlp_l", "prototype", invalid=(3,))
    x = images(96)
    y = np.random.default_rng(1).integers(0, 10, 96)
    out = tmp_path / "bundle"
    manifest = export_bundle(ckpt, out, variants=ALL_VARIANTS, samples=x, labels=y)

    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk == json.loads(json.dumps(manifest.to_dict()))
    assert on_disk["format"] == "edgefl.bundle/1"
    assert on_disk["verification_inputs"] == "real" and on_disk["num_samples"] == 96
    assert on_disk["source"]["sha256"] == file_sha256(ckpt)
    assert on_disk["export"]["head_type"] == "prototype"
    assert on_disk["calibration"]["source"] == "samples"
    assert on_disk["calibration"]["num_samples"] == 96
    assert [f["variant"] for f in on_disk["files"]] == list(ALL_VARIANTS)
    sizes = {}
    for rec in manifest.files:
        path = out / rec.file
        assert file_sha256(path) == rec.sha256 and path.stat().st_size == rec.size_bytes
        assert rec.verification is not None and rec.verification.inputs == "real"
        assert rec.verification.providers_used == ["CPUExecutionProvider"]
        assert rec.accuracy is not None and 0.0 <= rec.accuracy <= 1.0
        assert rec.latency_ms_b1 > 0
        meta = read_metadata(path)
        assert meta["precision"] == rec.variant
        assert meta["source_sha256"] == file_sha256(ckpt)
        graph = onnx.load(str(path)).graph  # io types unchanged in every variant
        assert graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        assert graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        _, label = run_batches(make_session(path), x)
        assert not (label == 3).any()  # the fp32 head keeps masking in every variant
        sizes[rec.variant] = rec.size_bytes
    fp32 = manifest.record("fp32")
    assert fp32.verification is not None and fp32.verification.passed
    assert fp32.accuracy_drop is None
    assert manifest.record("int8-static").accuracy_drop is not None
    assert sizes["int8-static"] < sizes["fp32"] / 2 and sizes["fp16"] < sizes["fp32"] * 0.6


@pytest.mark.parametrize("head", ["logits", "prototype"])
def test_every_variant_runs_by_the_documented_names(
    checkpoint: Callable[..., Path], tmp_path: Path, head: str
) -> None:
    # A deployment swaps model.onnx for model.int8.onnx and keeps calling run(["scores",
    # "label"], {"input": x}): every variant must answer to exactly the fp32 file's names.
    x = images(32)
    manifest = export_bundle(
        checkpoint("mlp_s", head), tmp_path / "b", variants=ALL_VARIANTS, samples=x, dynamo=False
    )
    for rec in manifest.files:
        path = tmp_path / "b" / rec.file
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        assert [i.name for i in sess.get_inputs()] == ["input"], rec.file
        assert [o.name for o in sess.get_outputs()] == ["scores", "label"], rec.file
        scores, label = sess.run(["scores", "label"], {"input": x})
        assert scores.shape == (32, 10) and label.dtype == np.int64, rec.file
        assert read_metadata(path)["outputs"].startswith("scores [batch, 10] float32; label")


def test_metadata_describes_the_run(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    ckpt = checkpoint("cnn_t1", "cosine", mean=(0.5,), std=(0.25,))
    manifest = export_bundle(ckpt, tmp_path / "b", dynamo=False)
    meta = read_metadata(tmp_path / "b" / "model.onnx")
    assert json.loads(meta["normalization"]) == {"mean": [0.5], "std": [0.25]}
    assert meta["pixel_scaling"].startswith("[0,1] float")
    assert json.loads(meta["class_names"]) == CLASS_NAMES
    assert (meta["algorithm"], meta["round"], meta["federation"]) == ("fedproto", "5", "fleet")
    assert meta["head_type"] == "cosine" and meta["model_name"] == "cnn_t1"
    assert json.loads(meta["input_shape"]) == ["batch", 1, 8, 8] and meta["in_chans"] == "1"
    assert meta["toolkit_version"] and meta["source_sha256"] == file_sha256(ckpt)
    assert manifest.metadata == meta


def test_without_samples_verification_is_random_and_says_so(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    manifest = export_bundle(
        checkpoint(), tmp_path / "b", variants=("fp16", "int8-dynamic"), dynamo=False
    )
    assert manifest.verification_inputs == "random"
    assert all(
        r.verification is not None and r.verification.inputs == "random" for r in manifest.files
    )
    assert all(r.accuracy is None for r in manifest.files)
    assert (
        json.loads((tmp_path / "b" / "manifest.json").read_text())["verification_inputs"]
        == "random"
    )


def test_no_verify_records_none(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    manifest = export_bundle(checkpoint(), tmp_path / "b", verify=False, dynamo=False)
    assert manifest.verification_inputs == "none" and manifest.files[0].verification is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"variants": ("int8-static",)}, "int8-static needs calibration samples"),
        ({"variants": ("int4",)}, r"unknown variant\(s\) \['int4'\]"),
        ({"labels": np.zeros(3, dtype=np.int64)}, "labels given without samples"),
        (
            {"samples": images(4), "labels": np.array([0, 1, 2, 10])},
            r"labels: values must lie in \[0, 10\)",
        ),
        ({"samples": images(4, (3, 8, 8))}, r"expected shape \[N, 1, 8, 8\]"),
    ],
)
def test_bad_requests_fail_before_exporting(
    checkpoint: Callable[..., Path], tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ExportError, match=message):
        export_bundle(checkpoint(), tmp_path / "b", **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "b").exists()
