"""A device whose privacy budget is spent says so (``PrivacyBudgetError``); on its verified word
the coordinator selects it for no further training step, and ``coordinator status`` shows it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from coordinator.config import load_config
from coordinator.engine.core import Coordinator
from coordinator.ops.lifecycle import read_run
from edge_agent.dp import PrivacyBudgetError
from edge_agent.membership import PRIVACY_LEDGER
from protocol.contract.codec import Envelope
from protocol.contract.messages import BUDGET_SPENT, ErrorReply
from protocol.transport.base import MemoryBroker
from tests.helpers_runtime import InProcessAgent, start_coordinator


def test_the_code_is_the_agents_exception_name() -> None:
    assert PrivacyBudgetError.__name__ == BUDGET_SPENT


@pytest.mark.parametrize("verified", [True, False])
def test_a_device_with_its_budget_spent_is_not_selected_again(
    verified: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: agent0's ledger already holds a release that spent the whole budget
    cfg = load_config(
        None,
        ["hyper.local_epochs=1", "hyper.dp.epsilon=4", "hyper.dp.releases=3"],
        algorithm="fedproto",
        rounds=3,
        run_dir=str(tmp_path / "run"),
        deadline_s=60.0,
        min_agents=3,
        run_id="t",
    )
    ledger = Path(cfg.run_dir) / "agents" / "agent0" / PRIVACY_LEDGER
    ledger.parent.mkdir(parents=True)
    ledger.write_text(json.dumps({"events": [[0.3, 10, 1.0]]}))
    if verified:  # as in a signed deployment: the coordinator can tell the device's own word
        original = Coordinator._on_error

        def signed(self: Coordinator, env: Envelope, error: ErrorReply) -> None:
            original(self, dataclasses.replace(env, verified=True), error)

        monkeypatch.setattr(Coordinator, "_on_error", signed)
    if not verified:  # the unverified error closes nothing: its slot waits for the deadline
        cfg = dataclasses.replace(cfg, deadline_s=3.0, grace_s=0.5)
    broker = MemoryBroker()
    agents = [InProcessAgent(cfg, broker, i).start() for i in range(3)]
    coord = start_coordinator(cfg, broker)
    coord.wait_for_agents(3, 60)
    # Execute
    result = coord.run()
    for a in agents:
        a.close()
    # Assert: round 1 records agent0's refusal; later rounds select it only without its
    # verified word; the final step (no training, no release) asks everyone
    first, *rest = [m for m in result.metrics if m["phase"] == "train"]
    assert f"{BUDGET_SPENT}: privacy budget spent" in first["failed"]["agent0"]
    for m in rest:
        assert ("agent0" in m["participants"]) is not verified
    final = [m for m in result.metrics if m["phase"] == "final"]
    assert final and "agent0" in final[0]["participants"]
    run = read_run(Path(cfg.run_dir))
    assert run is not None
    spent = {a.device_id: a.budget_spent for a in run.agents}
    assert spent == {"agent0": verified, "agent1": False, "agent2": False}
