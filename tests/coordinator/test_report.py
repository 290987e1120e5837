"""`coordinator report`: the markdown tables and the PNG, from synthetic metrics files."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from coordinator.metrics_log import load_metrics
from coordinator.report import plot_report, render_report, report_figure
from protocol.errors import ConfigError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _agent(local: float | None, glob: float | None, arch: str = "cnn_s") -> dict[str, Any]:
    return {"acc_local": local, "acc_global": glob, "loss": 0.5, "num_samples": 100, "arch": arch}


def _step(
    round_: int, phase: str, agents: dict[str, Any], nbytes: dict[str, int], **extra: Any
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "round": round_,
        "phase": phase,
        "time": 1.0e9 + round_,
        "duration_s": 0.5,
        "participants": sorted(agents),
        "quorum_met": True,
        "agents": agents,
        "bytes": nbytes,
        "bytes_total": sum(nbytes.values()),
    }
    record.update(extra)
    return record


def _write_run(
    run_dir: Path,
    records: list[dict[str, Any]],
    tail: str = "",
    config: dict[str, Any] | None = None,
) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records) + tail
    (run_dir / "metrics.jsonl").write_text(text)
    if config is not None:
        (run_dir / "run.json").write_text(json.dumps(config))
    return run_dir


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    records = [
        _step(
            1,
            "train",
            {"a": _agent(0.4, None, "mlp"), "b": _agent(0.6, None)},
            {"tx.task": 1000, "rx.reply": 2000},
            mean_acc_local=0.5,
            std_acc_local=0.1,
            mean_acc_global=None,
            std_acc_global=None,
        ),
        # no mean/std fields: computed from the agents
        _step(
            2,
            "train",
            {"a": _agent(0.6, 0.3, "mlp"), "b": _agent(0.8, 0.5)},
            {"tx.task": 1000, "rx.reply": 2500},
        ),
        _step(
            3,
            "finetune",
            {"a": _agent(None, 0.7, "mlp")},
            {"tx.task": 500},
            mean_acc_local=None,
            mean_acc_global=0.7,
            std_acc_global=0.0,
        ),
    ]
    config = {"run": {"run_id": "demo-7", "algorithm": "fedvtc", "rounds": 2}}
    return _write_run(tmp_path / "run", records, tail='{"round": 4, "phase": "tr', config=config)


def test_step_table(run_dir: Path) -> None:
    report = render_report(run_dir)
    assert report.startswith("# Run report: demo-7\n")
    assert "`run.algorithm=fedvtc`" in report
    assert "| 1 | 1 | train | 2 | 0.500 ± 0.100 | - | 3.00 kB | 3.00 kB |" in report
    assert "| 2 | 2 | train | 2 | 0.700 ± 0.100 | 0.400 ± 0.100 | 3.50 kB | 6.50 kB |" in report
    assert "| 3 | 3 | finetune | 1 | - | 0.700 ± 0.000 | 500 B | 7.00 kB |" in report


def test_agent_table_first_vs_last(run_dir: Path) -> None:
    report = render_report(run_dir)
    assert "| a | mlp | 3 | 0.400 | 0.600 | 0.300 | 0.700 | +0.400 |" in report
    assert "| b | cnn_s | 2 | 0.600 | 0.800 | 0.500 | 0.500 | +0.000 |" in report


def test_traffic_by_kind_and_skipped_line(run_dir: Path) -> None:
    report = render_report(run_dir)
    assert "3 steps, 7.00 kB in total." in report
    assert "| rx.reply | 4.50 kB |" in report and "| tx.task | 2.50 kB |" in report
    assert "- line 4: truncated last line" in report


def test_server_table_shows_each_steps_aggregate_numbers_a_column_each(tmp_path: Path) -> None:
    agents = {"a": _agent(0.5, None)}
    records = [
        _step(1, "train", agents, {}, aggregate={"knowledge_entries": 167.0, "classes": [1, 2]}),
        _step(2, "train", agents, {}),  # no aggregate: no row
        _step(
            3,
            "train",
            agents,
            {},
            aggregate={"knowledge_entries": 11060.0, "cvae_kl_per_dim": 4.885e-08, "ok": True},
        ),
    ]
    report = render_report(_write_run(tmp_path / "run", records))
    server = report[report.index("## Server") :].splitlines()
    # lists and booleans are not numbers; a key first seen later gets its column, "-" before
    assert server[2] == "| step | round | phase | `knowledge_entries` | `cvae_kl_per_dim` |"
    assert server[4:] == ["| 1 | 1 | train | 167 | - |", "| 3 | 3 | train | 11060 | 4.885e-08 |"]


def test_no_server_table_without_aggregate_numbers(run_dir: Path) -> None:
    assert "## Server" not in render_report(run_dir)


def test_summary_best_round_and_last_ten_rounds_by_hand(tmp_path: Path) -> None:
    # agent a holds 100 samples, b 300: personalised = (a + 3 b) / 4 = x + 0.3 with b = a + 0.4
    # (the plain mean, x + 0.2, would differ); acc_global is the same for both agents
    xs = [0.1, 0.5, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.3]
    gs = [0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.9, 0.3, 0.3, 0.3, 0.3, 0.3]
    records = [
        _step(
            r,
            "train",
            {
                "a": {**_agent(x, g), "num_samples": 100},
                "b": {**_agent(x + 0.4, g), "num_samples": 300},
            },
            {},
        )
        for r, (x, g) in enumerate(zip(xs, gs, strict=True), start=1)
    ]
    records[-1]["stop"] = {
        "reason": "patience",
        "monitor": "acc_local_weighted",
        "patience": 10,
        "min_delta": 0.0,
        "best_round": 2,
        "best": 0.8,
    }
    # the final phase counts other samples: weighted by the training rounds' (0.4 + 3 * 0.8) / 4
    final = {
        "a": {**_agent(0.4, 0.5), "num_samples": 5000},
        "b": {**_agent(0.8, 0.5), "num_samples": 10},
    }
    records.append(_step(13, "final", final, {}))
    report = render_report(_write_run(tmp_path / "run", records))
    # last 10 rounds = rounds 3..12: x averages (9 * 0.2 + 0.3) / 10 = 0.21, g (9 * 0.3 + 0.9) / 10
    assert "12 training rounds." in report
    assert (
        "| personalised accuracy (own test splits, sample-weighted) `acc_local_weighted` | 2 "
        "| 0.800 | 0.510 | - | 0.700 |" in report  # 12 rounds: no two windows of 10
    )
    assert (
        "| global accuracy (shared test set, mean over agents) `acc_global` | 7 | 0.900 | 0.360 "
        "| - | 0.500 |" in report
    )
    assert (
        "Stopped early: `acc_local_weighted` best 0.800 at round 2, not bettered by more than "
        "0.0 for 10 rounds." in report
    )


def test_summary_late_gain_is_the_last_ten_rounds_against_the_ten_before(
    tmp_path: Path,
) -> None:
    # 25 rounds: rounds 6-15 at 0.5, rounds 16-25 at 0.6 (one agent: personalised = its own)
    xs = [0.1] * 5 + [0.5] * 10 + [0.6] * 10
    records = [
        _step(r, "train", {"a": {**_agent(x, 0.3), "num_samples": 100}}, {})
        for r, x in enumerate(xs, start=1)
    ]
    report = render_report(_write_run(tmp_path / "run", records))
    assert "`acc_local_weighted` | 16 | 0.600 | 0.600 | +0.100 | 0.600 |" in report
    assert "`acc_global` | 1 | 0.300 | 0.300 | +0.000 | 0.300 |" in report


def test_invalid_middle_lines_and_null_fields(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "r", [{"round": None, "agents": None, "bytes": None}])
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write("[1, 2]\n{broken\n\n")
        fh.write(json.dumps({"phase": "eval", "bytes_total": 10, "participants": ["x"]}) + "\n")
    log = load_metrics(run)
    assert len(log.steps) == 2 and [n for n, _ in log.skipped] == [2, 3]
    report = render_report(run)
    assert "| 1 | - | - | 0 | - | - | 0 B | 0 B |" in report
    assert "| 2 | - | eval | 1 | - | - | 10 B | 10 B |" in report
    assert "- line 2: a JSON list, not an object" in report
    assert "- line 3: invalid JSON" in report
    assert "| - | - | 0 | - | - | - | - | - |" in report  # no agent ever reported


def test_broken_run_json_is_reported_not_fatal(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "r", [_step(1, "train", {"a": _agent(0.5, 0.5)}, {})])
    (run / "run.json").write_text("{nope")
    report = render_report(run)
    assert "Configuration: run.json unreadable" in report
    assert report.startswith("# Run report: r\n")


def test_empty_and_missing_runs(tmp_path: Path) -> None:
    empty = _write_run(tmp_path / "empty", [])
    assert "No completed step in metrics.jsonl." in render_report(empty)
    with pytest.raises(ConfigError, match="no completed step to plot"):
        plot_report(empty, tmp_path / "x.png")
    with pytest.raises(ConfigError, match=r"no metrics.jsonl in .*absent"):
        render_report(tmp_path / "absent")


def test_plot_writes_a_valid_png(run_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = plot_report(run_dir, tmp_path / "plots" / "report.png")
    data = out.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1000, 800)


def test_plot_without_matplotlib_names_the_extra(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError, match=r"pip install 'edgefl\[report\]'"):
        plot_report(run_dir, tmp_path / "x.png")


def _panels(fig: Any) -> dict[str, Any]:
    return {ax.get_ylabel().split()[0]: ax for ax in fig.axes if ax.get_ylabel()}


def _tick_labels(axis: Any) -> list[Any]:
    """The labels of the ticks inside the view (matplotlib keeps a few more, never drawn)."""
    lo, hi = sorted(axis.get_view_interval())
    ticks = [t for t in axis.get_major_ticks() if lo - 1e-9 <= t.get_loc() <= hi + 1e-9]
    return [label for t in ticks for label in (t.label1, t.label2) if t.get_visible()]


def _texts(fig: Any) -> list[Any]:
    """Every piece of text the PNG shows (tick labels only where ticks are in view)."""
    texts = [fig._suptitle, *(t for legend in fig.legends for t in legend.get_texts())]
    for ax in [a for top in fig.axes for a in (top, *top.child_axes)]:
        texts += [*_tick_labels(ax.xaxis), *_tick_labels(ax.yaxis)]
        texts += [*ax.texts, ax.xaxis.label, ax.yaxis.label, ax.title]
    return [t for t in texts if t is not None and t.get_visible() and t.get_text().strip()]


def test_plot_has_round_ticks_labelled_band_curves_per_architecture_and_units(
    run_dir: Path,
) -> None:
    pytest.importorskip("matplotlib")
    fig = report_figure(load_metrics(run_dir))
    fig.canvas.draw()
    panels = _panels(fig)
    assert set(panels) == {"local", "global", "cumulative"}
    traffic = panels["cumulative"]
    assert traffic.get_xlabel() == "round"
    ticks = [t.get_text() for t in _tick_labels(traffic.xaxis) if t.get_visible()]
    assert ticks == ["1", "2", "3"]  # whole rounds only, no 1.5
    assert traffic.get_ylabel() == "cumulative traffic (kB)"  # 7000 bytes, not 0.007 MB
    assert list(traffic.lines[0].get_ydata()) == [3.0, 6.5, 7.0]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["fleet ± 1 std over agents", "fleet mean", "cnn_s (b)", "mlp (a)"]
    top = panels["local"].child_axes[0]  # phase names above the panels, centred on their span
    assert [t.get_text() for t in top.get_xticklabels()] == ["train", "finetune"]


def test_plot_text_never_overlaps(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    agents = {f"dev{i}": _agent(0.1 * i, 0.05 * i, f"arch_{i % 3}") for i in range(7)}
    phases = ["setup", *["train"] * 10, "finetune", "finetune", "final"]
    records = [
        _step(r, phase, agents, {"tx.task": 4_000_000, "rx.reply": 9_000_000})
        for r, phase in enumerate(phases, start=1)
    ]
    fig = report_figure(load_metrics(_write_run(tmp_path / "long", records)))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in _texts(fig)]
    clashes = [
        (a, b)
        for i, (a, box) in enumerate(boxes)
        for b, other in boxes[i + 1 :]
        if box.overlaps(other)
    ]
    assert not clashes
    legend = fig.legends[0].get_window_extent(renderer)
    assert not any(legend.overlaps(ax.get_window_extent(renderer)) for ax in _panels(fig).values())
    assert all(fig.bbox.contains(*box.min) and fig.bbox.contains(*box.max) for _, box in boxes)
    assert _panels(fig)["cumulative"].get_ylabel() == "cumulative traffic (MB)"


def test_plot_falls_back_to_steps_when_rounds_repeat(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    records = [_step(1, "train", {"a": _agent(0.5, 0.5)}, {}), _step(1, "eval", {}, {})]
    fig = report_figure(load_metrics(_write_run(tmp_path / "r", records)))
    assert _panels(fig)["cumulative"].get_xlabel() == "step"
