"""What leaves a device in a run of each algorithm, read from the declarations the code runs
by: the strategy's :attr:`~coordinator.strategies.Strategy.needs_class_counts` (what a
registration carries) and the config's ``REPLY_PAYLOADS`` (what each phase's replies carry,
checked on every reply), and whether ``hyper.dp`` covers them (the config's
``DP_STATISTICS``, ``dp_sgd_trains`` and ``dp_uncovered``, at its defaults).
``docs/concepts/privacy.md`` holds the table this module renders;
``python -m coordinator.disclosure --check`` (and a test) says whether it is current.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from coordinator.strategies import STRATEGIES
from protocol.algorithms import config_type

__all__ = ["BEGIN", "END", "PAYLOAD_REVEALS", "disclosure_table", "main"]

BEGIN = "<!-- disclosure table: python -m coordinator.disclosure -->"
END = "<!-- end of disclosure table -->"
DOC = Path(__file__).resolve().parents[1] / "docs" / "concepts" / "privacy.md"

#: What a payload of each kind reveals of the device's data (``protocol/WIRE.md`` §12).
PAYLOAD_REVEALS: dict[str, str] = {
    "tensors": "model weights",
    "protos": "per-class mean vectors with exact per-class counts (and SDs where sent)",
    "featlogits": "per-class mean features and logits with exact per-class counts",
    "classstats": "per-class feature means and covariances with exact per-class counts",
    "labelled": "individual samples' features with their labels",
    "ivpairs": "generator samples (no device data)",
}


def _registration(name: str) -> str:
    if not STRATEGIES[name].needs_class_counts:
        return "class set and size"
    if getattr(config_type(name), "DP_STATISTICS", False):
        return "label histogram (`class_counts`; noised under `hyper.dp`)"
    return "label histogram (`class_counts`)"


def _replies(name: str) -> str:
    declared = config_type(name).REPLY_PAYLOADS
    if declared is None:
        return "not declared"
    phases = [
        f"`{phase}`: "
        + ", ".join(f"`{s.key}` ({s.kind.KIND}{'' if s.required else ', optional'})" for s in specs)
        for phase, specs in sorted(declared.items())
        if specs
    ]
    return "; ".join(phases) or "nothing"


def _dp(name: str) -> str:
    cfg = config_type(name)()
    sgd = bool(getattr(cfg, "DP_SGD", False) or cfg.dp_sgd_trains())  # type: ignore[attr-defined]
    stats = bool(getattr(cfg, "DP_STATISTICS", False))
    uncovered = cfg.dp_uncovered()  # type: ignore[attr-defined]
    if not (sgd or stats):
        return f"refused: {uncovered}"
    parts = []
    if sgd:
        parts.append(
            "every model the step trains is trained by DP-SGD (the weights sent among them)"
        )
    if stats:
        parts.append("sums and counts noised")
    text = " and ".join(parts)
    if sgd and stats:
        text += ", on one budget (the sums' part: `hyper.dp.share`)"
    return f"{text}; refused while {uncovered}" if uncovered else text


def disclosure_table() -> str:
    """The markdown table: algorithm -> registration, payloads per phase of its replies, and
    what ``hyper.dp`` does to them."""
    lines = [
        "| algorithm | registers | each reply's payloads (phase: key (kind)) | `hyper.dp` |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| `{n}` | {_registration(n)} | {_replies(n)} | {_dp(n)} |" for n in sorted(STRATEGIES)
    ]
    kinds = [f"| `{k}` | {v} |" for k, v in PAYLOAD_REVEALS.items()]
    return "\n".join([*lines, "", "| kind | reveals |", "| --- | --- |", *kinds])


def _splice(text: str, table: str) -> str:
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise SystemExit(f"{DOC}: the markers {BEGIN!r} and {END!r} are missing")
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    """Write the table into the privacy page, or (``--check``) say whether it is current."""
    parser = argparse.ArgumentParser(prog="python -m coordinator.disclosure")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    text = DOC.read_text()
    new = _splice(text, disclosure_table())
    if args.check:
        if new != text:
            print(f"{DOC} is stale: run python -m coordinator.disclosure", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
