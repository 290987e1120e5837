"""Verify an ONNX export against its PyTorch reference on real samples.

The criterion, per score element, is numpy's ``allclose`` widened by PyTorch's own float32
error: ``|onnx - torch| <= atol + rtol * |torch| + ref_factor * e64``, where ``e64`` is the
largest difference between the float32 PyTorch scores and the same model run in float64 on the
same samples. fp32 defaults: ``atol=1e-4``, ``rtol=1e-5`` (about 100 float32 ulps: prototype
scores are squared distances in the hundreds, where a pure ``atol`` would only measure
summation order), ``ref_factor=4``, 100 % agreement. The ``e64`` term matters for deep
networks only: float32 rounding grows with depth (ResNet-152 with realistic activations:
PyTorch float32 is 2.9e-4 from float64 and ONNX Runtime 2.8e-4 from PyTorch, ResNet-18 under
1e-6), and an export can be expected to match PyTorch no better than PyTorch matches the exact
result. A real export bug (a wrong weight, a missing normalisation, a transposed prototype
table) is off by 1e-2 or more.

Label agreement is judged on *decisive* samples only: a sample whose two best PyTorch scores
lie within twice the score tolerance of each other is a near tie, where a difference the
tolerance allows may legitimately flip the argmax. Near ties are counted in the report, and the
raw agreement (all samples) is reported too.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from export._graph import check_model
from export.runtime import check_images, make_session, run_batches
from protocol.errors import ExportError

__all__ = [
    "FP32_TOLERANCE",
    "InputKind",
    "Tolerance",
    "VerificationError",
    "VerifyReport",
    "compare_onnx",
    "verify_onnx",
]

InputKind = Literal["real", "random"]


@dataclass(frozen=True)
class Tolerance:
    """Pass criterion: ``|d| <= atol + rtol * |ref| + ref_factor * e64`` per score, label
    agreement >= minimum (``e64``: PyTorch float32 vs float64; skipped when ``ref_factor=0``)."""

    atol: float
    rtol: float
    min_agreement: float
    ref_factor: float = 0.0


FP32_TOLERANCE = Tolerance(atol=1e-4, rtol=1e-5, min_agreement=1.0, ref_factor=4.0)


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of comparing ONNX Runtime with PyTorch.

    Attributes:
        path: The ONNX file.
        passed: Whether every criterion held.
        num_samples: Samples compared.
        inputs: ``"real"`` (caller's samples) or ``"random"`` (uniform [0, 1] noise).
        max_abs_diff: Largest ``|onnx - torch|`` over all scores.
        worst_ratio: Largest ``|d| / bound``; the scores pass when <= 1.
        reference_error: ``e64``, the largest |PyTorch float32 - float64| score difference
            (0 when not measured).
        agreement: Fraction of samples with the same label (all samples).
        tolerance: The criterion applied.
        providers_requested: Execution providers asked for.
        providers_used: Providers the session actually got.
        seconds: Wall time of the comparison.
        near_ties: Samples excluded from the agreement criterion (top-2 PyTorch scores within
            twice the score tolerance).
        failures: Human-readable reasons when not passed.
    """

    path: str
    passed: bool
    num_samples: int
    inputs: InputKind
    max_abs_diff: float
    worst_ratio: float
    agreement: float
    tolerance: Tolerance
    providers_requested: list[str]
    providers_used: list[str]
    seconds: float
    reference_error: float = 0.0
    near_ties: int = 0
    failures: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


class VerificationError(ExportError):
    """The export disagrees with PyTorch beyond the stated tolerance."""

    def __init__(self, report: VerifyReport) -> None:
        self.report = report
        super().__init__(
            f"{report.path}: ONNX does not match PyTorch on {report.num_samples} "
            f"{report.inputs} samples: " + "; ".join(report.failures)
        )


def compare_onnx(
    path: str | os.PathLike[str],
    model_with_head: nn.Module,
    samples: np.ndarray,
    *,
    tolerance: Tolerance = FP32_TOLERANCE,
    providers: Sequence[str] | None = None,
    inputs: InputKind = "real",
    batch_size: int = 64,
) -> VerifyReport:
    """Run ONNX Runtime and PyTorch on ``samples`` and measure their agreement (never raises on
    a mismatch; see :func:`verify_onnx`)."""
    start = time.perf_counter()
    sess = make_session(path, providers)
    x = check_images(samples, _image_shape(sess.session.get_inputs()[0].shape, path))
    got_scores, got_labels = run_batches(sess, x, batch_size)
    ref_scores, ref_labels = _torch_outputs(model_with_head, x, batch_size)
    e64 = (
        _reference_error(model_with_head, x, ref_scores, batch_size)
        if tolerance.ref_factor > 0
        else 0.0
    )
    failures: list[str] = []
    if got_scores.shape != ref_scores.shape:
        failures.append(
            f"scores shape {list(got_scores.shape)} vs PyTorch {list(ref_scores.shape)}"
        )
        diff, ratio = float("inf"), float("inf")
    else:
        err = np.abs(got_scores.astype(np.float64) - ref_scores.astype(np.float64))
        bound = (
            tolerance.atol
            + tolerance.ref_factor * e64
            + tolerance.rtol * np.abs(ref_scores.astype(np.float64))
        )
        err = np.where(np.isnan(err), np.inf, err)  # NaN in either output is a failure
        diff, ratio = float(err.max()), float((err / bound).max())
        if ratio > 1.0:
            failures.append(
                f"max |score diff| {diff:.3g} exceeds atol {tolerance.atol:g} + "
                f"rtol {tolerance.rtol:g}·|ref| + {tolerance.ref_factor:g}·"
                f"{e64:.2g} (PyTorch's own float32 error) (worst ratio {ratio:.3g})"
            )
    same = got_labels.reshape(-1) == ref_labels.reshape(-1)
    agreement = float(np.mean(same))
    ties = _near_ties(ref_scores, tolerance, e64)
    if ties.shape != same.shape:  # scores of another shape: judge every sample
        ties = np.zeros_like(same)
    decisive = float(np.mean(same[~ties])) if (~ties).any() else 1.0
    if decisive < tolerance.min_agreement:
        failures.append(
            f"label agreement {decisive:.2%} < {tolerance.min_agreement:.2%} "
            f"({int((~same & ~ties).sum())} of {int((~ties).sum())} decisive "
            "samples differ)"
        )
    return VerifyReport(
        path=str(Path(path)),
        passed=not failures,
        num_samples=len(x),
        inputs=inputs,
        max_abs_diff=diff,
        worst_ratio=ratio,
        agreement=agreement,
        tolerance=tolerance,
        providers_requested=list(sess.requested),
        providers_used=list(sess.used),
        seconds=time.perf_counter() - start,
        reference_error=e64,
        near_ties=int(ties.sum()),
        failures=failures,
    )


def verify_onnx(
    path: str | os.PathLike[str],
    model_with_head: nn.Module,
    samples: np.ndarray,
    *,
    atol: float = FP32_TOLERANCE.atol,
    rtol: float = FP32_TOLERANCE.rtol,
    min_agreement: float = FP32_TOLERANCE.min_agreement,
    ref_factor: float = FP32_TOLERANCE.ref_factor,
    providers: Sequence[str] | None = None,
    inputs: InputKind = "real",
) -> VerifyReport:
    """Check the file with the ONNX checker, then compare ORT with PyTorch on ``samples``.

    Args:
        path: The exported ONNX file.
        model_with_head: The PyTorch reference returning ``(scores, label)``
            (:func:`export.heads.with_head`).
        samples: ``[N, C, H, W]`` float images in [0, 1]; real data wherever available.
        atol: Absolute score tolerance.
        rtol: Relative score tolerance (against the PyTorch score).
        min_agreement: Minimum fraction of equal labels.
        ref_factor: Multiple of PyTorch's own float32 error (vs float64) added to the bound;
            0 skips the float64 pass.
        providers: ORT execution providers (default CPU); see ``providers_used`` in the report.
        inputs: Recorded in the report: whether ``samples`` are real data or random noise.

    Returns:
        The report (``passed`` is always True when this returns).

    Raises:
        ExportError: The checker rejects the file, ORT cannot run it, or the samples are
            malformed.
        VerificationError: The outputs disagree beyond the tolerance.
    """
    check_model(path)
    report = compare_onnx(
        path,
        model_with_head,
        samples,
        tolerance=Tolerance(atol, rtol, min_agreement, ref_factor),
        providers=providers,
        inputs=inputs,
    )
    if not report.passed:
        raise VerificationError(report)
    return report


def _near_ties(scores: np.ndarray, tolerance: Tolerance, e64: float = 0.0) -> np.ndarray:
    """``[N]`` bool: the two best scores are within twice the per-score tolerance."""
    if scores.ndim != 2 or scores.shape[1] < 2:
        return np.zeros(len(scores), dtype=bool)
    top2 = -np.partition(-scores.astype(np.float64), 1, axis=1)[:, :2]
    bound = tolerance.atol + tolerance.ref_factor * e64 + tolerance.rtol * np.abs(top2)
    return np.asarray(top2[:, 0] - top2[:, 1] <= bound.sum(axis=1))


def _image_shape(shape: Sequence[Any], path: str | os.PathLike[str]) -> tuple[int, ...]:
    dims = tuple(shape[1:])
    if len(dims) != 3 or not all(isinstance(d, int) for d in dims):
        raise ExportError(
            f"{path}: input shape {list(shape)} is not [batch, C, H, W] with static C, H, W"
        )
    return dims


def _reference_error(
    model: nn.Module, x: np.ndarray, ref_scores: np.ndarray, batch_size: int
) -> float:
    """Largest |float32 - float64| PyTorch score (a float64 copy of the model; 0 if it fails)."""
    try:
        model64 = copy.deepcopy(model).double()
        exact, _ = _torch_outputs(model64, x, batch_size, dtype=torch.float64)
    except (RuntimeError, TypeError):  # an op without a float64 kernel: no widening
        return 0.0
    if exact.shape != ref_scores.shape:
        return 0.0
    err = np.abs(exact - ref_scores.astype(np.float64))
    # Masked classes score float32's minimum, which float64 keeps exactly: no error there.
    return float(np.nan_to_num(err, nan=0.0, posinf=0.0).max(initial=0.0))


@torch.no_grad()
def _torch_outputs(
    model: nn.Module, x: np.ndarray, batch_size: int, dtype: torch.dtype = torch.float32
) -> tuple[np.ndarray, np.ndarray]:
    was_training = model.training
    model.eval()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    scores, labels = [], []
    keep = np.float64 if dtype == torch.float64 else np.float32
    try:
        for start in range(0, len(x), batch_size):
            batch = torch.from_numpy(x[start : start + batch_size]).to(device, dtype)
            s, lab = model(batch)
            scores.append(s.cpu().numpy().astype(keep))
            labels.append(lab.cpu().numpy())
    finally:
        model.train(was_training)
    return np.concatenate(scores), np.concatenate(labels)
