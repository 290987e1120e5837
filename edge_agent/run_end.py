"""How a run ended for one agent, judged from the coordinator's ``finished`` state *and* from
what the agent itself did, so that a ``finished`` nobody can vouch for never passes for a run
this agent completed.

A run's plan always ends with its ``final`` phase (every agent evaluates and exports), and a
coordinator that completes a run announces ``finished`` at round ``total_rounds`` exactly (a
coordinator that gives up announces the round it stopped in). So an agent has completed its run
only when it answered that run's ``final`` task and the state says ``round == total_rounds``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from protocol.contract.messages import CoordinatorState

__all__ = ["FINAL_PHASE", "RunEnd", "archive_run", "judge_end"]

#: the phase every run's plan ends with (``Strategy.final_steps``)
FINAL_PHASE = "final"

EndKind = Literal["completed", "gave_up", "unconfirmed"]


@dataclass(frozen=True)
class RunEnd:
    """How the run ``run_id`` ended for this agent, and the sentence that says so.

    ``completed``: finished with this agent's final phase done. ``gave_up``: the state says the
    run stopped before its last round. ``unconfirmed``: the state says finished, but this agent
    did not see the run's end (no final phase): it missed the end, or the state is forged.
    """

    kind: EndKind
    run_id: str
    message: str


def judge_end(state: CoordinatorState, *, did_final: bool, verified: bool) -> RunEnd:
    """The end a ``finished`` ``state`` of a run this agent joined means for it.

    ``did_final``: the agent answered the run's final task; ``verified``: the state's frame
    was signed by the coordinator (without signing, any client of the broker can publish it).
    """
    unsigned = (
        ""
        if verified
        else "; the state is unsigned, so any client of the broker could have published it "
        "(a kit from `coordinator provision` signs it)"
    )
    where = f"round {state.round} of {state.total_rounds}"
    if state.round != state.total_rounds:
        return RunEnd(
            "gave_up",
            state.run_id,
            f"run {state.run_id} ended at {where}: the coordinator gave up{unsigned}",
        )
    if not did_final:
        return RunEnd(
            "unconfirmed",
            state.run_id,
            f"run {state.run_id} is announced finished ({where}), but this agent has not done "
            f"its final phase: it did not finish the run{unsigned}",
        )
    return RunEnd("completed", state.run_id, f"run {state.run_id} finished")


def archive_run(root: Path, run_id: str, names: tuple[str, ...]) -> Path:
    """Move a run's files ``names`` (checkpoint, task record, outbox) from the state directory
    ``root`` to ``root/runs/RUN_ID``, so that a daemon starts the next run fresh."""
    dest = root / "runs" / run_id
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (root / name).exists():
            (root / name).replace(dest / name)
    return dest
