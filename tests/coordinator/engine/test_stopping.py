"""Early stopping: the rule over step records, the plan it cuts, and runs over the in-memory
transport that stop, resume and run to the cap."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_for

from coordinator.accuracy import round_value
from coordinator.config import RunConfig, load_config
from coordinator.engine import closing
from coordinator.engine.stopping import EarlyStop
from coordinator.strategies import Step, create_strategy
from coordinator.strategies.fedproto import FedProtoStrategy
from protocol.algorithms import config_type
from protocol.errors import ConfigError
from protocol.transport.base import MemoryBroker
from tests.helpers_runtime import InProcessAgent, crash_and_resume, run_config, start_coordinator

# acc_local of every agent by round: best at round 2 (round 3 only equals it), better again
# from round 5, which a run with patience 2 never reaches
PLATEAU = {1: 0.5, 2: 0.6, 3: 0.6, 4: 0.55, 5: 0.9, 6: 0.95}


def _round(number: int, local: float | None, n: int = 100, glob: float = 0.1) -> dict[str, Any]:
    agents = {"a": {"acc_local": local, "acc_global": glob, "num_samples": n}}
    return {"round": number, "phase": "train", "quorum_met": True, "agents": agents}


def _rule(**run: Any) -> EarlyStop:
    return EarlyStop(RunConfig(**{"rounds": 100, "patience": 2, **run}))


# ----- the rule -------------------------------------------------------------------------------
def test_stops_once_the_best_round_is_patience_rounds_old_and_notes_it_on_that_record() -> None:
    rule = _rule()
    records = [_round(r, acc) for r, acc in PLATEAU.items()]
    for record in records[:3]:
        rule.observe(record)
    assert rule.decision is None
    rule.observe(records[3])
    assert rule.decision is not None and rule.decision.round == 4
    assert records[3]["stop"] == {
        "reason": "patience",
        "monitor": "acc_local_weighted",
        "patience": 2,
        "min_delta": 0.0,
        "target": 0.0,
        "best_round": 2,
        "best": 0.6,
    }
    assert not any("stop" in r for r in records[:3])


def test_an_improvement_must_exceed_min_delta() -> None:
    rule = _rule(min_delta=0.05)
    for number, acc in ((1, 0.5), (2, 0.54), (3, 0.56), (4, 0.57), (5, 0.58)):
        rule.observe(_round(number, acc))
    assert rule.decision is not None and rule.decision.best is not None
    assert (rule.decision.round, rule.decision.best.round) == (5, 3)


def test_personalised_accuracy_is_sample_weighted_and_global_can_be_monitored() -> None:
    weighted = _rule(patience=1)
    weighted.observe(_round(1, 0.5))
    record = _round(2, 0.9, n=1)
    record["agents"]["b"] = {"acc_local": 0.1, "num_samples": 9}  # (0.9 + 0.9) / 10 = 0.18
    weighted.observe(record)
    assert weighted.decision is not None and weighted.decision.round == 2
    by_global = _rule(patience=1, monitor="acc_global")
    by_global.observe(_round(1, 0.9, glob=0.2))
    by_global.observe(_round(2, 0.1, glob=0.3))
    assert by_global.decision is None


def test_without_any_value_it_never_stops_and_the_cap_is_recorded() -> None:
    rule = _rule(rounds=4)
    records = [_round(r, None) for r in (1, 2, 3, 4)]
    for record in records[:3]:
        rule.observe(record)
    assert rule.decision is None
    rule.observe(records[3])
    assert records[3]["stop"]["reason"] == "rounds"
    assert records[3]["stop"]["best_round"] is None


def test_replay_of_stored_records_reaches_the_same_decision() -> None:
    records: list[dict[str, Any]] = [_round(r, PLATEAU[r]) for r in (1, 2, 3)]
    # a step that missed its quorum is retried on resume: it is no round of the rule's
    records.append({"round": 4, "phase": "train", "quorum_met": False})
    rule = _rule()
    rule.replay(records)
    assert rule.best is not None and rule.best.round == 2 and rule.decision is None
    rule.observe(_round(4, PLATEAU[4]))
    assert rule.decision is not None and rule.decision.round == 4


def test_patience_zero_is_off() -> None:
    rule = _rule(patience=0, rounds=3)
    for record in (records := [_round(r, 0.5) for r in (1, 2, 3)]):
        rule.observe(record)
    assert rule.decision is None and not any("stop" in r for r in records)


def test_the_config_refuses_bad_values() -> None:
    for bad in ({"patience": -1}, {"min_delta": -0.1}, {"monitor": "loss"}):
        with pytest.raises(ConfigError):
            RunConfig(**bad)


def _val_round(number: int, val: float, local: float = 0.9) -> dict[str, Any]:
    record = _round(number, local)
    record["agents"]["a"]["acc_val"] = val
    return record


def test_a_validation_split_makes_the_validation_accuracy_the_default_monitor() -> None:
    assert RunConfig().monitored == "acc_local_weighted"  # no split: personalised test
    split = {"hyper": {"validation_fraction": 0.2}}
    assert RunConfig(**split).monitored == "acc_val_weighted"
    assert RunConfig(monitor="acc_local_weighted", **split).monitored == "acc_local_weighted"


def test_the_validation_monitor_stops_on_acc_val_whatever_the_test_accuracy() -> None:
    rule = _rule(hyper={"validation_fraction": 0.2})
    # acc_local rises every round: a test-monitored run would never stop here
    for number, val in ((1, 0.5), (2, 0.7), (3, 0.65), (4, 0.6)):
        rule.observe(_val_round(number, val, local=0.5 + number / 10))
    assert rule.decision is not None and rule.decision.best is not None
    assert (rule.decision.round, rule.decision.best.round) == (4, 2)


def test_the_validation_accuracy_is_sample_weighted() -> None:
    record = _val_round(1, 0.9)  # 100 samples
    record["agents"]["b"] = {"acc_val": 0.0, "num_samples": 300}
    assert round_value(record, "acc_val_weighted") == pytest.approx(0.225)


def test_a_target_stops_the_rounds_once_the_monitor_reaches_it() -> None:
    rule = _rule(patience=0, stop_target=0.8, hyper={"validation_fraction": 0.2})
    records = [_val_round(n, v) for n, v in ((1, 0.5), (2, 0.79), (3, 0.8), (4, 0.95))]
    for record in records[:3]:
        rule.observe(record)
    assert rule.decision is not None and rule.decision.round == 3
    assert records[2]["stop"]["reason"] == "target"
    assert records[2]["stop"]["target"] == 0.8
    assert records[2]["stop"]["monitor"] == "acc_val_weighted"
    strategy = create_strategy("fedproto", config_type("fedproto")(), num_classes=10)
    cut = rule.cut(strategy.plan(100), strategy)
    assert [(s.round, s.phase) for s in cut][-2:] == [(3, "train"), (4, "final")]


def test_the_validation_monitor_without_a_validation_split_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"hyper\.validation_fraction"):
        load_config(None, ["run.monitor=acc_val_weighted", "run.patience=3"], run_dir="r")
    with pytest.raises(ConfigError, match="stop_target"):
        RunConfig(stop_target=1.5)
    with pytest.raises(ConfigError, match=r"validation_fraction must be in \[0, 0.5\]"):
        load_config(None, ["hyper.validation_fraction=0.6"], run_dir="r")


# ----- the plan -------------------------------------------------------------------------------
def test_the_cut_plan_keeps_the_algorithms_final_steps_after_the_last_round() -> None:
    strategy = create_strategy("fedvtc", config_type("fedvtc")(), num_classes=10)
    rule = _rule()
    plan = strategy.plan(10)
    for record in (_round(r, PLATEAU[r]) for r in (1, 2, 3, 4)):
        rule.observe(record)
    cut = rule.cut(plan, strategy)
    assert cut[:4] == plan[:4]
    assert cut[4:] == [Step(5, "upload_generator", "all"), Step(5, "final", "all")]
    assert rule.cut(cut, strategy) is cut  # cut once


# ----- runs -----------------------------------------------------------------------------------
@pytest.fixture
def plateau(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every agent's acc_local in a training round is PLATEAU's (the engine's record is
    rewritten before the rule and the store see it)."""
    original = closing.step_record

    def scripted(step: Step, *args: Any) -> dict[str, Any]:
        record = original(step, *args)
        if step.phase == "train":
            for agent in record["agents"].values():
                agent["acc_local"] = PLATEAU[step.round]
        return record

    monkeypatch.setattr(closing, "step_record", scripted)


def _agents(cfg: RunConfig, broker: MemoryBroker) -> list[InProcessAgent]:
    return [InProcessAgent(cfg, broker, i).start() for i in range(3)]


def _phases(cfg: RunConfig) -> list[tuple[int, str]]:
    lines = (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()
    return [(r["round"], r["phase"]) for r in map(json.loads, lines)]


@pytest.mark.usefixtures("plateau")
def test_a_plateau_stops_the_rounds_and_the_final_step_still_runs(tmp_path: Path) -> None:
    cfg = run_config(tmp_path, rounds=6, patience=2)
    broker = MemoryBroker()
    agents = _agents(cfg, broker)
    result = start_coordinator(cfg, broker).run()
    assert _phases(cfg) == [(1, "train"), (2, "train"), (3, "train"), (4, "train"), (5, "final")]
    assert result.steps == 5
    assert result.metrics[3]["stop"]["best_round"] == 2
    assert result.metrics[3]["stop"]["reason"] == "patience"
    # the agents saw a finished run, not a coordinator that gave up
    assert wait_for(lambda: all(a.agent is not None and a.agent.finished.is_set() for a in agents))
    assert all(a.agent is not None and a.agent.gave_up is None for a in agents)
    for a in agents:
        a.close()


class CrashOnceError(Exception):
    pass


@pytest.mark.usefixtures("plateau")
def test_a_resumed_coordinator_keeps_the_best_round_so_far(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the coordinator dies aggregating round 4; its successor knows round 2 as the best only
    # from the stored records (on its own it would take round 4 as the first and best)
    cfg = run_config(tmp_path, rounds=6, patience=2)
    broker = MemoryBroker()
    agents = _agents(cfg, broker)
    original = FedProtoStrategy.fold_prototypes
    crashed = threading.Event()

    def aggregate(self: FedProtoStrategy, step: Step, replies: Any) -> dict[str, float]:
        if step.round == 4 and not crashed.is_set():
            crashed.set()
            raise CrashOnceError
        return original(self, step, replies)

    monkeypatch.setattr(FedProtoStrategy, "fold_prototypes", aggregate)
    second = crash_and_resume(cfg, broker, CrashOnceError)
    assert second.stopping.best is not None and second.stopping.best.round == 2
    second.run()
    assert _phases(cfg) == [(1, "train"), (2, "train"), (3, "train"), (4, "train"), (5, "final")]
    for a in agents:
        a.close()


@pytest.mark.usefixtures("plateau")
def test_with_patience_zero_every_round_runs(tmp_path: Path) -> None:
    cfg = run_config(tmp_path, rounds=5)
    broker = MemoryBroker()
    agents = _agents(cfg, broker)
    result = start_coordinator(cfg, broker).run()
    assert [phase for _, phase in _phases(cfg)] == ["train"] * 5 + ["final"]
    assert not any("stop" in m for m in result.metrics)
    for a in agents:
        a.close()
