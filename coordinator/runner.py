"""Build and run a coordinator over any transport (used by serve, demo and simulate)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from coordinator.config import RunConfig
from coordinator.engine import Coordinator, RunResult
from coordinator.store import Store
from coordinator.strategies import create_strategy
from protocol.codec import Envelope, encode
from protocol.endpoint import Endpoint
from protocol.messages import CoordinatorState
from protocol.topics import Topics
from protocol.transport import Transport, Will

__all__ = ["coordinator_will", "make_coordinator", "run_coordinator"]

SENDER = "coordinator"


def coordinator_will(cfg: RunConfig) -> Will:
    """Retained ``offline`` state the broker publishes if the coordinator vanishes."""
    body = CoordinatorState(
        state="offline",
        run_id=cfg.run_id,
        algorithm=cfg.algorithm,
        round=0,
        total_rounds=cfg.rounds,
    )
    return Will(
        Topics(cfg.federation).coord_state,
        encode(Envelope(body=body, sender=SENDER, federation=cfg.federation)),
    )


def make_coordinator(
    cfg: RunConfig,
    transport: Transport,
    logger: logging.Logger | None = None,
    *,
    health_check: Callable[[], None] | None = None,
) -> Coordinator:
    """Open the run's store and strategy and wire them to ``transport``.

    ``health_check`` runs before every wait for messages and may raise to end the run.
    """
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    store = Store(run_dir / "state.sqlite")
    strategy = create_strategy(
        cfg.algorithm, cfg.algorithm_config(), num_classes=cfg.num_classes, seed=cfg.seed
    )
    endpoint = Endpoint(transport, sender=SENDER, federation=cfg.federation)
    return Coordinator(cfg, endpoint, store, strategy, logger, health_check=health_check)


def run_coordinator(
    cfg: RunConfig,
    transport: Transport,
    logger: logging.Logger | None = None,
    *,
    health_check: Callable[[], None] | None = None,
) -> RunResult:
    """Connect, run every step, disconnect."""
    coord = make_coordinator(cfg, transport, logger, health_check=health_check)
    try:
        coord.start()  # subscriptions first: queued messages of our session arrive on connect
        if not transport.connected:
            transport.connect()
        return coord.run()
    finally:
        coord.store.close()
