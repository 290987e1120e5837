"""The command-line flags that name a participant's credentials (both CLIs add them).

The flags name files, never secrets: ``ps`` shows every user of the machine a process's argv.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from protocol.security.credentials import ENV

__all__ = ["add_arguments"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--kit``, ``--credentials``, ``--no-signing`` and ``--insecure``: the flags name files,
    never secrets (``ps`` shows argv)."""
    parser.add_argument(
        "--kit",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"kit directory from `coordinator provision` (broker, id, TLS files, signing keys); "
        f"default ${ENV['kit']}",
    )
    parser.add_argument(
        "--credentials",
        type=Path,
        default=None,
        metavar="FILE",
        help="TOML with [mqtt] username/password, [tls] ca/cert/key, [signing] key/verify_keys "
        f"(default ${ENV['credentials']}); ${ENV['username']}, ${ENV['password']}, "
        f"${ENV['ca']}, ${ENV['cert']}, ${ENV['key']} override single values",
    )
    parser.add_argument(
        "--no-signing",
        action="store_true",
        help="do not sign or verify frames even though signing keys are available (a kit has "
        "them; by default every frame is signed and unsigned ones refused, WIRE.md §7)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="connect to a broker off this machine without TLS client authentication or "
        "signing (refused otherwise: anyone who reaches such a broker can read and forge every "
        "message); a loopback broker needs no flag",
    )
