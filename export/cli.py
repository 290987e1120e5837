"""``edge-export CHECKPOINT -o DIR``: re-export an agent checkpoint as an ONNX bundle.

Only argparse is imported at module level; torch, onnx and onnxruntime load inside
:func:`main` after the arguments parse, so ``--help`` and usage errors are instant.

Exit codes: 0 success; 2 bad input (missing/corrupt checkpoint, architecture mismatch,
unsupported op, bad data file) with one ``edge-export: error: ...`` line on stderr; 3 the
export was written but does not match PyTorch within tolerance.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from export._defaults import DEFAULT_DYNAMO, DEFAULT_OPSET

if TYPE_CHECKING:
    import numpy as np

    from export.bundle import Manifest

__all__ = ["build_parser", "main"]

EXIT_OK, EXIT_ERROR, EXIT_MISMATCH = 0, 2, 3


def build_parser() -> argparse.ArgumentParser:
    """The ``edge-export`` argument parser."""
    p = argparse.ArgumentParser(
        prog="edge-export",
        description="Export an edgefl agent checkpoint to ONNX (model + inference head), verify "
        "it against PyTorch and write a deployment bundle with manifest.json.",
    )
    p.add_argument("checkpoint", type=Path, help="agent checkpoint file (.pt)")
    p.add_argument(
        "--checkpoint",
        dest="which",
        choices=("best", "last"),
        default="best",
        help="best: the device's best round by its validation accuracy (checkpoint.best.pt "
        "beside CHECKPOINT, kept when the run has hyper.validation_fraction), the given file "
        "when there is none; last: the given file (default: %(default)s)",
    )
    p.add_argument("-o", "--out-dir", type=Path, required=True, help="bundle directory")
    p.add_argument("--fp16", action="store_true", help="also write model.fp16.onnx")
    p.add_argument(
        "--int8",
        action="append",
        nargs="?",
        const="static",
        choices=("static", "dynamic"),
        default=[],
        help="also write an int8 variant: static QDQ, per-channel, calibrated on "
        "--calibration or --data images (the default), or dynamic; repeatable",
    )
    p.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compare every file with PyTorch (default: on)",
    )
    p.add_argument(
        "--providers",
        default="CPUExecutionProvider",
        help="comma-separated ORT execution providers (default: %(default)s)",
    )
    p.add_argument(
        "--data",
        default=None,
        help="verification/accuracy images, any source edge-agent --data takes: digits, "
        "mnist5k, mnist[:test], fashion_mnist, cifar10, cifar100, an image-folder directory, "
        "or an .npz with x (uint8 or [0,1] floats) and optional y; without it verification "
        "uses random inputs",
    )
    p.add_argument(
        "--calibration",
        default=None,
        help="training images for int8 static calibration, same sources as --data "
        "(default: --data; pass this when --data is a test set)",
    )
    p.add_argument(
        "--data-root", default=None, help="root directory of torchvision datasets (as the agent)"
    )
    p.add_argument(
        "--image-size",
        type=int,
        default=None,
        help="resize --data/--calibration images to this size (as the agent's --image-size)",
    )
    p.add_argument(
        "--opset", type=int, default=DEFAULT_OPSET, help="ONNX opset (default: %(default)s)"
    )
    p.add_argument(
        "--exporter",
        choices=("dynamo", "legacy"),
        default="dynamo" if DEFAULT_DYNAMO else "legacy",
        help="torch exporter (default: %(default)s)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``edge-export``; returns the exit code."""
    args = build_parser().parse_args(argv)
    from protocol.errors import EdgeFLError

    try:
        manifest = _run(args)
    except EdgeFLError as exc:
        from export.verify import VerificationError

        print(f"edge-export: error: {exc}", file=sys.stderr)
        return EXIT_MISMATCH if isinstance(exc, VerificationError) else EXIT_ERROR
    except OSError as exc:  # unwritable output directory, unreadable data file
        print(f"edge-export: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    _print_summary(manifest)
    return EXIT_OK


def _run(args: argparse.Namespace) -> Manifest:
    from export.bundle import export_bundle
    from models.selection import choose

    selection = choose(args.checkpoint, args.which)
    x, y = _load_data(args, "--data") if args.data is not None else (None, None)
    calib = _load_data(args, "--calibration")[0] if args.calibration is not None else None
    variants = [
        "fp32",
        *(["fp16"] if args.fp16 else []),
        *(f"int8-{m}" for m in dict.fromkeys(args.int8)),
    ]
    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    return export_bundle(
        selection.path,
        args.out_dir,
        variants=variants,
        verify=args.verify,
        providers=providers,
        samples=x,
        labels=y,
        calibration=calib,
        opset=args.opset,
        dynamo=args.exporter == "dynamo",
        selection=selection.to_dict(),
    )


def _load_data(args: argparse.Namespace, flag: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Images and labels (None without) of ``--data`` or ``--calibration``, read the agent's way."""
    from edge_agent.data import load_images
    from protocol.errors import ConfigError, ExportError

    source = args.data if flag == "--data" else args.calibration
    try:
        return load_images(source, root=args.data_root, image_size=args.image_size)
    except ConfigError as exc:
        raise ExportError(f"{flag}: {exc}") from exc


def _print_summary(manifest: Manifest) -> None:
    chosen = manifest.checkpoint
    if chosen:
        print(
            f"checkpoint: {chosen['checkpoint']} ({chosen['file']}), round {chosen['round']}: "
            f"{chosen['note']}"
        )
    print(
        f"bundle: {manifest.path.parent}  (verification inputs: "
        f"{manifest.verification_inputs}, {manifest.num_samples} samples)"
    )
    for rec in manifest.files:
        parts = [f"{rec.file:<26}", f"{rec.size_bytes / 1e6:7.2f} MB"]
        if rec.verification is not None:
            v = rec.verification
            parts.append(
                f"{'ok' if v.passed else 'DIFFERS'} max|d| {v.max_abs_diff:.2g} "
                f"agree {v.agreement:.1%}"
            )
        if rec.accuracy is not None:
            # The manifest's accuracy_drop as it is (fp32 minus this file, in points: positive
            # is worse); + 0.0 turns -0.0 into 0.0, which prints as "+0.0".
            drop = "" if rec.accuracy_drop is None else f" (drop {rec.accuracy_drop + 0.0:+.1f} pt)"
            parts.append(f"acc {rec.accuracy:.1%}{drop}")
        parts.append(f"b1 {rec.latency_ms_b1:.3f} ms on {','.join(rec.providers_used)}")
        print("  ".join(parts))


if __name__ == "__main__":
    sys.exit(main())
