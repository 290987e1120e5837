"""Argument types shared by the command-line tools (``coordinator``, ``edge-agent``): they
refuse a bad value at parse time with argparse's usage message, not a traceback later."""

from __future__ import annotations

import argparse

__all__ = ["non_negative_int"]


def non_negative_int(text: str) -> int:
    """An integer >= 0 (a thread count where 0 means the libraries' default)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value
