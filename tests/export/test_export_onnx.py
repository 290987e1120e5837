"""export_model + verify_onnx: heads, metadata, exporters, errors (mlp_s/cnn_t1, 8x8 input)."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from export_helpers import images
from torch import nn

from export import (
    DEFAULT_OPSET,
    ExportResult,
    VerificationError,
    export_model,
    read_metadata,
    verify_onnx,
    with_head,
)
from export.heads import MASKED_SCORE
from export.runtime import make_session, provider_options, run_batches
from export.verify import Tolerance, _near_ties
from models import Classifier, create_model
from models.checkpoint import HeadSpec
from protocol.errors import ExportError

SHAPE = (1, 8, 8)


def _model(name: str = "mlp_s") -> Classifier:
    return create_model(name, num_classes=10, in_chans=1, input_size=8)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Classifier, ExportResult]:
    """One mlp_s logits export shared by the read-only tests (a dynamo export costs seconds)."""
    torch.manual_seed(0)
    model = _model()
    extra = {"class_names": json.dumps(["a", "b"]), "algorithm": "fedktl", "round": "9"}
    path = tmp_path_factory.mktemp("exported") / "m.onnx"
    return model, export_model(model, HeadSpec("logits"), path, input_shape=SHAPE, metadata=extra)


@pytest.mark.parametrize("kind", ["logits", "prototype", "cosine"])
def test_each_head_matches_pytorch(kind: str, tmp_path: Path) -> None:
    model = _model("cnn_t1")
    x = images(48)
    head = HeadSpec("logits")
    if kind != "logits":
        with torch.no_grad():
            feats = model.eval().forward_features(torch.from_numpy(x))
        protos = torch.randn(10, model.num_features)
        protos[2] = feats.mean(0)  # would win often: it must still never be predicted
        valid = torch.ones(10, dtype=torch.bool)
        valid[2] = False
        head = HeadSpec(kind, protos, valid)  # type: ignore[arg-type]
    result = export_model(model, head, tmp_path / "m.onnx", input_shape=SHAPE)
    report = verify_onnx(result.path, with_head(model, head), x)
    assert report.passed and report.agreement == 1.0 and report.num_samples == 48
    assert report.max_abs_diff <= 1e-4 + 1e-5 * 1e3
    assert 0.0 < report.reference_error < 1e-4  # PyTorch float32 vs float64, measured
    scores, label = run_batches(make_session(result.path), x)
    assert scores.dtype == np.float32 and label.dtype == np.int64
    if kind != "logits":
        assert not (label == 2).any()
        assert np.all(scores[:, 2] == np.float32(MASKED_SCORE))


def test_graph_signature_and_dynamic_batch(exported: tuple[Classifier, ExportResult]) -> None:
    _, result = exported
    graph = onnx.load(str(result.path)).graph
    assert [i.name for i in graph.input] == ["input"]
    assert [o.name for o in graph.output] == ["scores", "label"]
    dims = graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch" and [d.dim_value for d in dims[1:]] == [1, 8, 8]
    assert result.opset == DEFAULT_OPSET
    sess = make_session(result.path)
    for n in (1, 7):
        scores, label = run_batches(sess, images(n))
        assert scores.shape == (n, 10) and label.shape == (n,)


def test_metadata_round_trips(exported: tuple[Classifier, ExportResult]) -> None:
    _, result = exported
    meta = read_metadata(result.path)
    assert meta == result.metadata
    assert json.loads(meta["input_shape"]) == ["batch", 1, 8, 8]
    assert meta["in_chans"] == "1" and meta["head_type"] == "logits"
    assert meta["pixel_scaling"] == "[0,1] float, normalisation inside the graph"
    assert json.loads(meta["class_names"]) == ["a", "b"] and meta["round"] == "9"
    assert "stack_trace" not in onnx.load(str(result.path)).SerializeToString().decode("latin1")


def test_legacy_exporter_verifies_too(tmp_path: Path) -> None:
    model = _model("cnn_t1")
    head = HeadSpec("prototype", torch.randn(10, model.num_features))
    result = export_model(model, head, tmp_path / "m.onnx", input_shape=SHAPE, dynamo=False)
    assert result.exporter == "legacy"
    assert verify_onnx(result.path, with_head(model, head), images(16)).passed


def test_export_restores_mode_and_leaves_global_rng_alone(tmp_path: Path) -> None:
    model = _model().train()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    export_model(model, HeadSpec("logits"), tmp_path / "m.onnx", input_shape=SHAPE)
    assert model.training
    assert torch.equal(torch.rand(3), expected)


def test_mismatch_raises_verification_error(exported: tuple[Classifier, ExportResult]) -> None:
    _, result = exported
    torch.manual_seed(1)
    other = _model()  # different random weights
    with pytest.raises(
        VerificationError,
        match=r"does not match PyTorch on 16 real samples: "
        r"max \|score diff\|",
    ) as info:
        verify_onnx(result.path, with_head(other, HeadSpec("logits")), images(16))
    assert not info.value.report.passed


def test_near_ties_are_excluded_from_label_agreement() -> None:
    tol = Tolerance(atol=1e-4, rtol=1e-5, min_agreement=1.0)
    scores = np.array(
        [
            [5.0, 5.00005, -1.0],  # gap 5e-5 <= 2 * (1e-4 + 5e-5): a near tie
            [5.0, 4.9, -1.0],  # decisive
            [300.0, 300.005, 0.0],
        ],
        dtype=np.float32,
    )  # rtol widens the bound
    assert _near_ties(scores, tol).tolist() == [True, False, True]
    assert not _near_ties(scores[:, :1], tol).any()  # one class: never a tie


def test_providers_requested_vs_used(exported: tuple[Classifier, ExportResult]) -> None:
    model, result = exported
    report = verify_onnx(
        result.path,
        with_head(model, HeadSpec("logits")),
        images(4),
        providers=["CUDAExecutionProvider"],
    )
    assert report.providers_requested == ["CUDAExecutionProvider"]
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():  # fell back silently
        assert report.providers_used == ["CPUExecutionProvider"]
    with pytest.raises(ExportError, match=r"unknown execution provider\(s\) \['NopeProvider'\]"):
        make_session(result.path, ["NopeProvider"])


def test_gpu_provider_options_turn_the_trt_engine_cache_on(tmp_path: Path) -> None:
    trt = provider_options("TensorrtExecutionProvider", tmp_path / "cache")
    assert trt["trt_engine_cache_enable"] == "True"
    assert trt["trt_engine_cache_path"] == str(tmp_path / "cache")
    assert provider_options("CUDAExecutionProvider", tmp_path)["device_id"] == "0"
    assert provider_options("CPUExecutionProvider", tmp_path) == {}


def test_bad_samples_and_files_are_precise(
    exported: tuple[Classifier, ExportResult], tmp_path: Path
) -> None:
    model, result = exported
    ref = with_head(model, HeadSpec("logits"))
    with pytest.raises(ExportError, match=r"scaled to \[0, 1\].*got range \[0\.\d+, 254"):
        verify_onnx(result.path, ref, images(4) * 255)
    with pytest.raises(ExportError, match=r"expected shape \[N, 1, 8, 8\], got \[4, 3, 8, 8\]"):
        verify_onnx(result.path, ref, images(4, (3, 8, 8)))
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(result.path.read_bytes()[:200])
    with pytest.raises(ExportError, match="ONNX checker rejected the model"):
        verify_onnx(broken, ref, images(4))


def test_dynamo_opset_17_fallback_is_caught(tmp_path: Path) -> None:
    # The cosine head's ReduceL2 defeats torch's down-conversion, which then keeps opset 18
    # with only a log line: export_model turns that into an error instead of a wrong file.
    head = HeadSpec("cosine", torch.randn(10, 64))
    with pytest.raises(ExportError, match="produced opset 18 instead of the requested 17"):
        export_model(_model(), head, tmp_path / "m.onnx", input_shape=SHAPE, opset=17)


class _Bessel(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.special.bessel_j0(x.flatten(1))  # no ONNX translation
        return out


def test_unsupported_op_names_the_op(tmp_path: Path) -> None:
    model = Classifier(_Bessel(), 64, num_classes=3, in_chans=1, input_size=(8, 8))
    with pytest.raises(ExportError, match=r"cannot export Classifier .*dynamo.*bessel_j0"):
        export_model(model, HeadSpec("logits"), tmp_path / "m.onnx", input_shape=SHAPE)
    assert not (tmp_path / "m.onnx").exists()


def test_dynamo_export_keeps_onnxscript_info_lines_quiet(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # An agent logs at INFO; onnxscript's optimiser would add a dozen INFO lines per export.
    caplog.set_level(logging.INFO)
    export_model(_model(), HeadSpec("logits"), tmp_path / "m.onnx", input_shape=SHAPE)
    noisy = [
        r.getMessage()
        for r in caplog.records
        if r.name.split(".")[0] in ("onnxscript", "onnx_ir") and r.levelno < logging.WARNING
    ]
    assert not noisy, noisy[:3]
    for name in ("onnxscript", "onnx_ir"):  # the user's own setting is left alone afterwards
        assert logging.getLogger(name).level == logging.NOTSET


def test_exports_from_several_threads_run_one_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Simulated agents are threads of one process, and torch.export's tracing state is global:
    # concurrent dynamo exports failed with "s77 is not tracked with proxy" and KeyErrors.
    barrier = threading.Barrier(2, timeout=1.0)
    active, peak = [0], [0]
    guard = threading.Lock()

    def fake_export(*args: object, **kwargs: object) -> None:
        with guard:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            barrier.wait()  # both threads get here only when exports overlap
        except threading.BrokenBarrierError:
            pass
        finally:
            with guard:
                active[0] -= 1
        raise RuntimeError("fake exporter")

    monkeypatch.setattr(torch.onnx, "export", fake_export)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            export_model(_model(), HeadSpec("logits"), tmp_path / f"{i}.onnx", input_shape=SHAPE)
        except ExportError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 2 and all("fake exporter" in str(e) for e in errors)
    assert peak[0] == 1
