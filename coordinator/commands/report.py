"""``coordinator report``: a run directory's markdown table and PNG plot."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.commands.options import Subparsers

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> None:
    rep = sub.add_parser("report", help="markdown table and PNG plot of a run directory")
    rep.add_argument("run_dir", type=Path)
    rep.add_argument(
        "--png", type=Path, default=None, help="plot path (default RUN_DIR/report.png)"
    )


def run(args: argparse.Namespace) -> int:
    from coordinator.report import plot_report, render_report

    print(render_report(args.run_dir))
    png = args.png or args.run_dir / "report.png"
    plot_report(args.run_dir, png)
    print(f"\nplot: {png}")
    return 0
