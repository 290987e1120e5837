"""``coordinator report RUN_DIR``: a markdown summary and a PNG of a run's ``metrics.jsonl``.

The file is read by :mod:`coordinator.metrics_log`; this module renders what it read.
matplotlib is imported only by :func:`plot_report`, with the Agg canvas and no pyplot state.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from coordinator.accuracy import (
    LAST_ROUNDS,
    PERSONALISED,
    best_round,
    last_mean,
    late_gain,
    round_value,
    round_values,
    sample_weights,
    training_rounds,
)
from coordinator.metrics_log import (
    METRICS_FILE,
    MetricsLog,
    StepRow,
    as_int,
    load_metrics,
    number_at,
)
from protocol.errors import ConfigError

__all__ = [
    "plot_report",
    "render_report",
    "report_figure",
]


# ----- markdown ----------------------------------------------------------------------------------
def render_report(run_dir: str | Path) -> str:
    """A markdown report: the run's summaries (best round, mean of the last rounds), one row
    per step, a first-vs-last table per agent, traffic by kind, and the numbers the algorithm's
    server half reported each step.

    Raises:
        ConfigError: ``RUN_DIR/metrics.jsonl`` does not exist.
    """
    log = load_metrics(run_dir)
    out = [f"# Run report: {_title(log)}", ""]
    out += _config_lines(log)
    if log.steps:
        out += [*_summary(log.records), ""]
        out += ["## Steps", ""]
        out += [*_steps_table(log.steps), "", *_agents_table(log.steps), ""]
        out += _traffic_table(log.steps)
        out += _server_table(log.records)
    else:
        out.append(f"No completed step in {METRICS_FILE}.")
    if log.skipped:
        out += ["", "Skipped lines of metrics.jsonl:"]
        out += [f"- line {number}: {reason}" for number, reason in log.skipped]
    return "\n".join(out) + "\n"


def _title(log: MetricsLog) -> str:
    cfg = log.config or {}
    run = cfg.get("run") if isinstance(cfg.get("run"), dict) else cfg
    name = run.get("run_id") if isinstance(run, dict) else None
    return str(name) if name else log.run_dir.name


def _config_lines(log: MetricsLog) -> list[str]:
    if log.config_error:
        return [f"Configuration: {log.config_error}", ""]
    if not log.config:
        return []
    flat = _flatten(log.config)
    return ["Configuration: " + ", ".join(f"`{k}={v}`" for k, v in flat.items()), ""]


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        elif value is None or isinstance(value, (str, int, float, bool)):
            flat[f"{prefix}{key}"] = value
    return flat


SUMMARIES = (
    (PERSONALISED, "personalised accuracy (own test splits, sample-weighted)"),
    ("acc_global", "global accuracy (shared test set, mean over agents)"),
)


def _summary(records: list[dict[str, Any]]) -> list[str]:
    """Both summaries of the training rounds for each metric (and its value in the last step,
    e.g. after the final phase), and why the rounds ended."""
    rounds = training_rounds(records)
    weights = sample_weights(rounds)  # the last step may count other samples (a final phase's)
    rows = [
        "## Summary",
        "",
        f"{len(rounds)} training rounds.",
        "",
        f"| metric | best round | best | mean of the last {LAST_ROUNDS} rounds | late gain "
        "| last step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for metric, label in SUMMARIES:
        best = best_round(rounds, metric)
        late = last_mean(rounds, metric)
        counted = min(LAST_ROUNDS, len(round_values(rounds, metric)))
        rows.append(
            f"| {label} `{metric}` | {_fmt(best.round if best else None)} "
            f"| {_fmt(best.value if best else None)} "
            f"| {_fmt(late)}{f' ({counted} rounds)' if 0 < counted < LAST_ROUNDS else ''} "
            f"| {_fmt(late_gain([p.value for p in round_values(rounds, metric)]), signed=True)} "
            f"| {_fmt(round_value(records[-1], metric, weights) if records else None)} |"
        )
    stop = next((r["stop"] for r in reversed(rounds) if isinstance(r.get("stop"), dict)), None)
    if stop is not None:
        rows += ["", _stop_line(stop)]
    return rows


def _stop_line(stop: Mapping[str, Any]) -> str:
    best = f"best {_fmt(number_at(stop, 'best'))} at round {_fmt(as_int(stop.get('best_round')))}"
    if stop.get("reason") == "patience":
        return (
            f"Stopped early: `{stop.get('monitor')}` {best}, not bettered by more than "
            f"{stop.get('min_delta')} for {stop.get('patience')} rounds."
        )
    if stop.get("reason") == "target":
        return f"Stopped early: `{stop.get('monitor')}` reached the target {stop.get('target')}."
    return f"Early stopping (patience {stop.get('patience')}) ran to the cap: {best}."


def _steps_table(steps: list[StepRow]) -> list[str]:
    rows = [
        "| step | round | phase | participants | local acc | global acc | bytes (step) "
        "| bytes (total) |",
        "|---:|---:|---|---:|---|---|---:|---:|",
    ]
    cumulative = 0
    for i, s in enumerate(steps, start=1):
        cumulative += s.bytes_step
        rows.append(
            f"| {i} | {_fmt(s.round)} | {s.phase} | {s.participants} "
            f"| {_pm(s.mean_local, s.std_local)} | {_pm(s.mean_global, s.std_global)} "
            f"| {_fmt_bytes(s.bytes_step)} | {_fmt_bytes(cumulative)} |"
        )
    return rows


def _agents_table(steps: list[StepRow]) -> list[str]:
    rows = [
        "## Agents (first vs last step)",
        "",
        "| agent | arch | steps | local acc first | local acc last | global acc first "
        "| global acc last | global acc change |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    devices = sorted({d for s in steps for d in s.agents})
    for device in devices:
        points = [s.agents[device] for s in steps if device in s.agents]
        local = [p.acc_local for p in points if p.acc_local is not None]
        glob = [p.acc_global for p in points if p.acc_global is not None]
        change = glob[-1] - glob[0] if glob else None
        rows.append(
            f"| {device} | {points[-1].arch} | {len(points)} "
            f"| {_fmt(local[0] if local else None)} | {_fmt(local[-1] if local else None)} "
            f"| {_fmt(glob[0] if glob else None)} | {_fmt(glob[-1] if glob else None)} "
            f"| {_fmt(change, signed=True)} |"
        )
    if not devices:
        rows.append("| - | - | 0 | - | - | - | - | - |")
    return rows


def _traffic_table(steps: list[StepRow]) -> list[str]:
    kinds: dict[str, int] = {}
    for s in steps:
        for kind, n in s.bytes_by_kind.items():
            kinds[kind] = kinds.get(kind, 0) + n
    total = sum(s.bytes_step for s in steps)
    rows = ["## Traffic", "", f"{len(steps)} steps, {_fmt_bytes(total)} in total.", ""]
    if kinds:
        rows += ["| direction.kind | bytes |", "|---|---:|"]
        rows += [f"| {k} | {_fmt_bytes(n)} |" for k, n in sorted(kinds.items())]
    return rows


def _server_table(records: list[dict[str, Any]]) -> list[str]:
    """The numbers in each step's ``aggregate`` (the server half's diagnostics: Velo's CVAE
    loss and KL per latent dimension, a knowledge table's size, ...), a column each, for the
    steps that have any; nothing when no step has one."""
    rows: list[tuple[int, dict[str, Any], dict[str, float]]] = []
    keys: dict[str, None] = {}  # in order of first appearance
    for i, record in enumerate(records, start=1):
        agg = record.get("aggregate")
        agg = agg if isinstance(agg, Mapping) else {}
        numbers = {str(k): v for k in agg if (v := number_at(agg, k)) is not None}
        if numbers:
            rows.append((i, record, numbers))
            keys.update(dict.fromkeys(numbers))
    if not rows:
        return []
    out = [
        "",
        "## Server",
        "",
        "| step | round | phase | " + " | ".join(f"`{k}`" for k in keys) + " |",
        "|---:|---:|---|" + "---:|" * len(keys),
    ]
    for i, record, numbers in rows:
        cells = " | ".join(_number(numbers[k]) if k in numbers else "-" for k in keys)
        phase = record.get("phase") if isinstance(record.get("phase"), str) else "-"
        out.append(f"| {i} | {_fmt(as_int(record.get('round')))} | {phase} | {cells} |")
    return out


def _number(value: float) -> str:
    """A counted number whole (``11060``), any other to four significant digits."""
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.4g}"


def _fmt(value: float | None, *, signed: bool = False) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:+.3f}" if signed else f"{value:.3f}"


def _pm(mean: float | None, std: float | None) -> str:
    if mean is None:
        return "-"
    return f"{mean:.3f} ± {std:.3f}" if std is not None else f"{mean:.3f}"


def _fmt_bytes(n: int) -> str:
    """Decimal units, three significant digits: ``950 B``, ``12.3 kB``, ``1.50 MB``."""
    if n < 1000:
        return f"{n} B"
    value = float(n)
    for unit in ("kB", "MB", "GB", "TB"):
        value /= 1000.0
        if value < 999.5 or unit == "TB":
            break
    decimals = 2 if value < 9.995 else 1 if value < 99.95 else 0
    return f"{value:.{decimals}f} {unit}"


# ----- plot --------------------------------------------------------------------------------------
FIGSIZE = (10.0, 8.0)  # inches at 100 dpi: 1000 x 800 pixels
BYTE_UNITS = (("B", 1.0), ("kB", 1e3), ("MB", 1e6), ("GB", 1e9), ("TB", 1e12))


def plot_report(run_dir: str | Path, out_png: str | Path) -> Path:
    """Write a PNG: local and global accuracy per round (fleet mean, its ±1 std band and one
    curve per architecture) and the cumulative traffic.

    Returns:
        The path written.

    Raises:
        ConfigError: No metrics, no completed step, or matplotlib is not installed.
    """
    log = load_metrics(run_dir)
    if not log.steps:
        raise ConfigError(f"{Path(run_dir) / METRICS_FILE} has no completed step to plot")
    fig = report_figure(log)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out


def report_figure(log: MetricsLog) -> Any:
    """The report's matplotlib ``Figure`` (Agg canvas attached), for :func:`plot_report`."""
    figure_cls, canvas_cls = _matplotlib()
    from matplotlib.ticker import MaxNLocator

    fig = figure_cls(figsize=FIGSIZE, layout="constrained")
    canvas_cls(fig)
    local_ax, global_ax, traffic_ax = fig.subplots(3, 1, sharex=True)
    xs, xlabel = _x_values(log.steps)
    groups = _groups(log.steps)
    colors = {name: f"C{i % 10}" for i, name in enumerate(groups)}
    for ax, key, label in (
        (local_ax, "local", "local accuracy\n(own test split)"),
        (global_ax, "global", "global accuracy\n(shared test set)"),
    ):
        _accuracy_panel(ax, log.steps, xs, key, groups=groups, colors=colors)
        ax.set_ylabel(label)
    _traffic_panel(traffic_ax, log.steps, xs)
    traffic_ax.set_xlabel(xlabel)
    traffic_ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    traffic_ax.set_xlim(xs[0] - 0.5, xs[-1] + 0.5)
    _phases(log.steps, xs, (local_ax, global_ax, traffic_ax))
    fig.suptitle(f"Run {_title(log)}")
    handles, labels = local_ax.get_legend_handles_labels()
    if handles:  # beside the panels, never over a curve
        fig.legend(handles, labels, loc="outside right upper", fontsize=8)
    return fig


def _x_values(steps: list[StepRow]) -> tuple[list[int], str]:
    """Round numbers when every step has its own, increasing; else step numbers."""
    rounds = [s.round for s in steps if s.round is not None]
    if len(rounds) == len(steps) and all(a < b for a, b in itertools.pairwise(rounds)):
        return rounds, "round"
    return list(range(1, len(steps) + 1)), "step"


def _groups(steps: list[StepRow]) -> dict[str, list[str]]:
    """Legend label -> devices: one curve per architecture (per agent when none is known)."""
    arch: dict[str, str] = {}
    for step in steps:
        for device, point in step.agents.items():
            if point.arch != "-" or device not in arch:
                arch[device] = point.arch
    by_key: dict[str, list[str]] = {}
    for device in sorted(arch):
        by_key.setdefault(arch[device] if arch[device] != "-" else device, []).append(device)
    return {
        f"{key} ({devices[0] if len(devices) == 1 else f'{len(devices)} agents'})": devices
        for key, devices in sorted(by_key.items())
    }


def _accuracy_panel(
    ax: Any,
    steps: list[StepRow],
    xs: list[int],
    key: str,
    *,
    groups: dict[str, list[str]],
    colors: dict[str, str],
) -> None:
    means = [getattr(s, f"mean_{key}") for s in steps]
    stds = [getattr(s, f"std_{key}") for s in steps]
    ys = [math.nan if m is None else m for m in means]
    lo = [max(0.0, y - d) if d is not None else math.nan for y, d in zip(ys, stds, strict=True)]
    hi = [min(1.0, y + d) if d is not None else math.nan for y, d in zip(ys, stds, strict=True)]
    ax.fill_between(
        xs, lo, hi, color="0.5", alpha=0.25, linewidth=0, label="fleet ± 1 std over agents"
    )
    ax.plot(xs, ys, color="black", linewidth=2, marker="o", markersize=3, label="fleet mean")
    for label, devices in groups.items():
        curve = [_group_mean(s, devices, key) for s in steps]
        ax.plot(xs, curve, color=colors[label], linewidth=1, linestyle="--", label=label)
    if all(m is None for m in means):
        ax.text(0.5, 0.5, f"no {key} accuracy recorded", transform=ax.transAxes, ha="center")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)


def _group_mean(step: StepRow, devices: list[str], key: str) -> float:
    values = [getattr(step.agents[d], f"acc_{key}") for d in devices if d in step.agents]
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else math.nan


def _traffic_panel(ax: Any, steps: list[StepRow], xs: list[int]) -> None:
    cumulative, total = [], 0
    for s in steps:
        total += s.bytes_step
        cumulative.append(total)
    unit, scale = _byte_unit(total)
    ax.plot(xs, [c / scale for c in cumulative], marker="o", markersize=3, color="tab:purple")
    ax.set_ylabel(f"cumulative traffic ({unit})")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)


def _byte_unit(n: int) -> tuple[str, float]:
    """The largest decimal unit in which ``n`` is at least 1 (as the markdown tables)."""
    chosen = BYTE_UNITS[0]
    for unit in BYTE_UNITS:
        if n >= unit[1]:
            chosen = unit
    return chosen


def _phases(steps: list[StepRow], xs: list[int], axes: tuple[Any, ...]) -> None:
    """Dashed lines between phases, and each phase's name above the top panel, centred."""
    spans: list[tuple[str, int, int]] = []  # phase, first index, last index
    for i, step in enumerate(steps):
        if spans and spans[-1][0] == step.phase:
            spans[-1] = (step.phase, spans[-1][1], i)
        else:
            spans.append((step.phase, i, i))
    for _, first, _ in spans[1:]:  # e.g. into fine-tuning: dashed, as in the papers' curves
        for ax in axes:
            ax.axvline((xs[first - 1] + xs[first]) / 2, color="grey", linestyle="--", linewidth=1)
    # A secondary axis takes part in the layout: the names cannot collide with the title.
    top = axes[0].secondary_xaxis("top")
    top.set_xticks([(xs[a] + xs[b]) / 2 for _, a, b in spans], labels=[p for p, _, _ in spans])
    top.tick_params(length=0, labelsize=8, labelcolor="grey")


def _matplotlib() -> tuple[Any, Any]:
    try:
        import matplotlib  # noqa: F401 - fails first, and clearly, when matplotlib is absent
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigError(
            "plotting a report needs matplotlib: pip install 'edgefl[report]'"
        ) from exc
    return Figure, FigureCanvasAgg
