"""``coordinator ingest-worker`` that takes replies off the broker and never stores them: it
writes ``MARKER`` when it holds one, then hangs, so that a test can kill it with SIGKILL while
replies are in its hands (received and acknowledged to the broker, not stored, not acked to the
device), the case the round leader must recover from. Run as ``python -m``."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from coordinator.cli import main
from coordinator.engine.ingest_worker import IngestWorker


def _hang(marker: Path) -> None:
    def process(self: IngestWorker, batch: list[object]) -> None:
        if batch:
            marker.write_text(str(len(batch)))
            threading.Event().wait()  # until SIGKILL

    IngestWorker.process = process  # type: ignore[assignment,method-assign]


if __name__ == "__main__":
    _hang(Path(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
