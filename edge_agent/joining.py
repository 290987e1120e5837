"""How an agent joins a run: it waits for the federation's coordinator to announce one (its
retained state, verified where signing is on) and adopts what the run announces (algorithm,
class names, feature size) where its own flags leave them open.

Torch-free: ``edge-agent`` imports it before the models load.
"""

from __future__ import annotations

import argparse
import logging
import threading
from pathlib import Path
from typing import Any, NamedTuple

from protocol.algorithms.base import DEFAULT_FEATURE_DIM

__all__ = ["Adopted", "adopt", "class_list", "feature_size", "trusted_state", "wait_for_run"]


class Adopted(NamedTuple):
    """What an agent takes from the run it joins unless its flags fix it."""

    algorithm: str
    classes: tuple[str, ...]
    feature_dim: int | None  # None: native features


def feature_size(given: int | None, required: int = 0) -> int | None:
    """``--feature-dim`` (0: native, ``None``), else what the run requires, else the default."""
    if given is not None:
        return given or None
    return required or DEFAULT_FEATURE_DIM


def adopt(args: argparse.Namespace, state: Any) -> Adopted:
    """What the run ``state`` announces, where the flags leave it open."""
    log = logging.getLogger("edgefl.agent")
    algorithm = args.algorithm or state.algorithm
    if args.algorithm is None:
        log.info("run %s uses %s; adopting it", state.run_id, state.algorithm)
    if args.feature_dim is None and state.feature_dim:
        log.info(
            "run %s requires %d-dimensional features; building the model with them",
            state.run_id,
            state.feature_dim,
        )
    feature_dim = feature_size(args.feature_dim, state.feature_dim)
    if args.classes:
        return Adopted(algorithm, class_list(args.classes), feature_dim)
    if state.classes:
        log.info("run %s names %d classes; adopting them", state.run_id, len(state.classes))
    return Adopted(algorithm, tuple(state.classes), feature_dim)


def wait_for_run(
    args: argparse.Namespace, transport: Any, stop: threading.Event, agent: Any
) -> Any:
    """The retained state of the federation's current run (``None`` if stopped first, or if a
    run ``agent`` had joined, per its checkpoint, is finished: the agent has judged its end).

    Waits for a coordinator that is starting or running (not one that finished or vanished):
    an agent adopts what the run it joins runs, and the classes it names. With signing, only
    a verified state counts: a forged one could make the agent adopt another algorithm. The
    ``finished`` of a run the agent never joined is logged, and the agent waits for the next.
    """
    import queue

    from protocol.contract.messages import CoordinatorState
    from protocol.contract.topics import Topics
    from protocol.errors import ProtocolError

    states: queue.Queue[CoordinatorState] = queue.Queue()
    # its own replay cache: the agent's endpoint receives the same retained state again
    verifier = None if args.signing is None else args.signing.verifier()
    done = threading.Event()  # the transport has no unsubscribe: stop looking instead
    log = logging.getLogger("edgefl.agent")

    def on_state(_topic: str, data: bytes) -> None:
        if done.is_set() or not data:
            return
        try:
            state = trusted_state(data, verifier)
        except ProtocolError as exc:
            log.warning("ignored a coordinator state: %s", exc)
            return
        if state is not None:
            states.put(state)

    transport.subscribe(Topics(args.federation).coord_state, on_state)
    transport.connect(retry_for=args.connect_retry)
    log.info("waiting for a coordinator of federation %s to join its run", args.federation)
    try:
        while not stop.is_set():
            try:
                state = states.get(timeout=0.5)
            except queue.Empty:
                continue
            if state.state in ("starting", "running"):
                return state
            if state.state == "finished":
                agent.on_coordinator_state(state)
                if agent.finished.is_set():
                    return None
        return None
    finally:
        done.set()


def trusted_state(data: bytes, verifier: Any) -> Any:
    """The :class:`CoordinatorState` in a frame, if it may be acted on (``None``: a hint only).

    With a verifier (signing on) the state must be signed by the coordinator; an unsigned one
    is its last will or a forgery. Without one, signed frames cannot be opened. Either way its
    sender must be the coordinator (``COORDINATOR_ID``): a device's key verifies too.

    Raises:
        ProtocolError: undecodable, badly signed, stale or replayed.
    """
    from protocol.contract.codec import decode_frame_map, envelope_from_map
    from protocol.contract.messages import CoordinatorState
    from protocol.contract.topics import COORDINATOR_ID
    from protocol.errors import SignatureError, ValidationError

    obj = decode_frame_map(data)
    signed = "sm" in obj
    if signed:
        if verifier is None:
            raise SignatureError("it is signed, and signing is off (--no-signing or no key)")
        env = verifier.open(obj)
    else:
        env = envelope_from_map(obj)
    body = env.body
    if not isinstance(body, CoordinatorState):
        return None
    if env.sender != COORDINATOR_ID:
        raise ValidationError("coord_state sender", repr(COORDINATOR_ID), env.sender)
    if not signed and verifier is not None:
        if body.state != "offline":
            logging.getLogger("edgefl.agent").warning(
                "ignored an unsigned coordinator state %r: signatures are required", body.state
            )
        return None
    return body


def class_list(text: str) -> tuple[str, ...]:
    """``zero,one,two`` or ``@classes.txt`` (one name a line) -> the names, in order."""
    from protocol.errors import ConfigError

    if text.startswith("@"):
        try:
            lines = Path(text[1:]).read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"--classes {text}: {exc}") from exc
        names = [line.strip() for line in lines if line.strip()]
    else:
        names = [n.strip() for n in text.split(",")]
    if not names or not all(names):
        raise ConfigError(f"--classes {text!r}: expected class names, comma-separated or @FILE")
    return tuple(names)
