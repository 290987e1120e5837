"""A round's accuracy and a run's two summaries of it, defined once for the early stop,
``coordinator report`` and the benchmarks.

A step record (a line of ``metrics.jsonl``) holds, per evaluated agent, ``acc_local`` (its
model on its own test split), ``acc_global`` (on the test set all agents share) and
``num_samples``. The metrics a round is summarised by:

- ``acc_local_weighted``: personalised accuracy, sample-weighted: the agents' ``acc_local``
  weighted by their samples, i.e. sum(correct) / sum(samples) over the agents' own splits (as
  HtFLlib reports it). The record's ``num_samples`` counts an agent's training samples; the
  stratified split holds out the same share of every agent's data for its test split, so the
  weights are the test splits' sizes up to rounding (the benchmarks pass the exact sizes).
- ``acc_val_weighted``: the same over ``acc_val``, each agent's accuracy on its validation
  split (``hyper.validation_fraction`` of its training data, never trained on): what a run
  may stop on without choosing its rounds by the test data it reports.
- ``acc_local``: the plain mean of ``acc_local`` over the agents (the record's
  ``mean_acc_local``).
- ``acc_global``: the mean of ``acc_global`` over the agents (``mean_acc_global``); every agent
  is scored on the same test set, so no weights.

The summaries, over the training rounds: the best round (its number and value) and the mean of
the last :data:`LAST_ROUNDS` rounds; and the late gain, that mean minus the mean of the
:data:`LAST_ROUNDS` rounds before them, which says whether a run stopped by a round cap was
still improving.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from protocol.contract.messages import Reply
from protocol.errors import ValidationError

__all__ = [
    "LAST_ROUNDS",
    "MONITORS",
    "PERSONALISED",
    "VALIDATION",
    "RoundValue",
    "best_round",
    "check_accuracies",
    "last_mean",
    "late_gain",
    "personalised_accuracy",
    "round_value",
    "round_values",
    "sample_weights",
    "training_rounds",
]

PERSONALISED = "acc_local_weighted"
VALIDATION = "acc_val_weighted"
MONITORS = (PERSONALISED, "acc_global", VALIDATION)  # what early stopping can watch
# the weighted metrics, by the agents' key they weigh
_WEIGHTED = {PERSONALISED: "acc_local", VALIDATION: "acc_val"}
# accuracies a reply may report, each a share of samples: what the stop rule and the report read
ACCURACIES = ("acc_local", "acc_global", "acc_val")
LAST_ROUNDS = 10

Record = Mapping[str, Any]


@dataclass(frozen=True)
class RoundValue:
    """A metric's value in one training round."""

    round: int
    value: float


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def check_accuracies(reply: Reply) -> None:
    """Raise :class:`ValidationError` for an accuracy of ``reply.metrics`` outside [0, 1]
    (finite it is already): one such value would outweigh a round's every other agent."""
    for key in ACCURACIES:
        value = reply.metrics.get(key)
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValidationError(f"reply.metrics.{key}", "an accuracy in [0, 1]", value)


def personalised_accuracy(
    agents: Mapping[str, Record],
    weights: Mapping[str, float] | None = None,
    key: str = "acc_local",
) -> float | None:
    """``key`` (``acc_local``, or ``acc_val``) of ``agents`` weighted by ``weights[device]``
    (default: each agent's ``num_samples``); None when no agent has both."""
    total = correct = 0.0
    for device, agent in agents.items():
        if not isinstance(agent, Mapping):
            continue
        acc = _number(agent.get(key))
        weight = _number(agent.get("num_samples") if weights is None else weights.get(device))
        if acc is None or weight is None or weight <= 0:
            continue
        total += weight
        correct += weight * acc
    return correct / total if total else None


def sample_weights(rounds: Iterable[Record]) -> dict[str, float]:
    """Each agent's ``num_samples`` in the last of ``rounds`` it took part in: the weights of a
    step whose replies count something else (FedVTC's ``final`` counts synthetic samples)."""
    out: dict[str, float] = {}
    for record in rounds:
        agents = record.get("agents")
        for device, agent in agents.items() if isinstance(agents, Mapping) else ():
            n = _number(agent.get("num_samples")) if isinstance(agent, Mapping) else None
            if n is not None:
                out[device] = n
    return out


def round_value(
    record: Record, metric: str, weights: Mapping[str, float] | None = None
) -> float | None:
    """``metric`` of one step record: :data:`PERSONALISED` or :data:`VALIDATION` (``weights``
    as :func:`personalised_accuracy`'s), or ``KEY`` for the recorded ``mean_KEY`` (else the
    mean of the agents' ``KEY``)."""
    agents = record.get("agents")
    agents = agents if isinstance(agents, Mapping) else {}
    if metric in _WEIGHTED:
        return personalised_accuracy(agents, weights, _WEIGHTED[metric])
    recorded = _number(record.get(f"mean_{metric}"))
    if recorded is not None:
        return recorded
    values = [
        v
        for a in agents.values()
        if isinstance(a, Mapping) and (v := _number(a.get(metric))) is not None
    ]
    return statistics.fmean(values) if values else None


def training_rounds(records: Iterable[Record]) -> list[Record]:
    """The records of training rounds that closed (a step that missed its quorum did not)."""
    return [r for r in records if r.get("phase") == "train" and r.get("quorum_met") is not False]


def round_values(rounds: Iterable[Record], metric: str) -> list[RoundValue]:
    """``metric`` of every round of ``rounds`` that has a value, in order."""
    out = []
    for record in rounds:
        value, number = round_value(record, metric), record.get("round")
        if value is not None and isinstance(number, int):
            out.append(RoundValue(number, value))
    return out


def best_round(rounds: Iterable[Record], metric: str) -> RoundValue | None:
    """The round of ``rounds`` with the highest ``metric`` (the first of equals)."""
    best: RoundValue | None = None
    for point in round_values(rounds, metric):
        if best is None or point.value > best.value:
            best = point
    return best


def last_mean(rounds: Iterable[Record], metric: str, last: int = LAST_ROUNDS) -> float | None:
    """The mean of ``metric`` over the last ``last`` rounds of ``rounds`` that have a value."""
    values = [p.value for p in round_values(rounds, metric)][-last:]
    return statistics.fmean(values) if values and last > 0 else None


def late_gain(values: Sequence[float], last: int = LAST_ROUNDS) -> float | None:
    """The mean of the last ``last`` of ``values`` (a metric's values in round order) minus the
    mean of the ``last`` before them; None with fewer than ``2 * last`` values."""
    if last < 1 or len(values) < 2 * last:
        return None
    tail = values[-2 * last :]
    return statistics.fmean(tail[last:]) - statistics.fmean(tail[:last])
