"""Plots (PNG) and a text summary of a run, read from ``output_dir/metrics.jsonl``.

Each line of metrics.jsonl is one log event: a JSON object with ``step`` (global step), ``epoch`` and the
scalars logged at that moment. Keys come and go between events (evaluation events carry ``eval_*`` keys,
the final event ``train_runtime`` and friends), so every metric is a series of (step, value) taken from
the events that have it. Non-numeric values are skipped.

Figures, each one panel per metric and only for metrics that have data:
  training.png  loss, learning_rate, grad_norm
  rewards.png   GRPO and DPO keys: reward*, rewards/*, kl, entropy, clip_ratio/*, completions/*,
                logps/*, logits/*
  eval.png      eval_* keys
  other.png     every remaining series
The end-of-run summary keys (``train_*``, ``total_flos``: one value per run) are left out of the plots
and appear in ``summarize``.

matplotlib is imported inside the plotting functions, and only its object-oriented API with the Agg
canvas is used, so nothing here touches pyplot's global state or needs a display.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from matplotlib.figure import Figure

METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"  # GRPO's sampled completions (log_completions=True), one JSON record a line
TRAINING_KEYS = ("loss", "learning_rate", "grad_norm", "mean_token_accuracy")
RL_PREFIXES = ("reward", "frac_reward", "kl", "entropy", "clip_ratio", "completions/", "logps/", "logits/")
SUMMARY_PREFIXES = ("train_", "total_flos")  # one value at the end of a run: a table row, not a plot
NOT_METRICS = ("step", "epoch")  # the axes of every series, not series themselves
FIGURE_TITLES = {"training": "Training", "rewards": "Rewards and policy statistics",
                 "eval": "Evaluation", "other": "Other metrics"}

Series = dict[str, tuple[list[float], list[float]]]  # metric -> (steps, values)


# ----------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------

def metrics_path(run_dir: str | Path) -> Path:
    """The metrics file of a run folder (or the file itself); ValueError when it is not there."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / METRICS_FILE
    elif not path.exists():
        raise ValueError(f"run folder {path} does not exist")
    if not path.is_file():
        raise ValueError(f"{path} not found: is {run_dir} the output_dir of a treadle run?")
    return path


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """The log events of a run, in file order.

    Raises ValueError naming the file (and the line, ``file:line``) when the folder or file is missing,
    the file holds no events, or a line is not a JSON object with a numeric ``step``.
    Blank lines are ignored.
    """
    path = metrics_path(run_dir)
    events = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                events.append(_parse_event(line, f"{path}:{number}"))
    if not events:
        raise ValueError(f"{path} is empty: the run logged no events")
    return events


def _parse_event(line: str, where: str) -> dict[str, Any]:
    try:
        event = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: corrupt line, not valid JSON ({error.msg})") from None
    if not isinstance(event, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(event).__name__}")
    if not _is_number(event.get("step")):
        raise ValueError(f"{where}: event has no numeric 'step'")
    return event


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def collect_series(events: list[dict[str, Any]]) -> Series:
    """Every numeric metric as (steps, values), keys in order of first appearance."""
    series: Series = {}
    for event in events:
        for key, value in event.items():
            if key in NOT_METRICS or not _is_number(value):
                continue
            steps, values = series.setdefault(key, ([], []))
            steps.append(event["step"])
            values.append(float(value))
    return series


def panel_layout(series: Series) -> dict[str, list[str]]:
    """Figure name -> the metrics drawn in it, one panel each; figures without metrics are left out."""
    layout: dict[str, list[str]] = {name: [] for name in FIGURE_TITLES}
    layout["training"] = [key for key in TRAINING_KEYS if key in series]
    for key in series:
        if key in TRAINING_KEYS or key.startswith(SUMMARY_PREFIXES):
            continue
        if key.startswith("eval_"):
            layout["eval"].append(key)
        elif key.startswith(RL_PREFIXES):
            layout["rewards"].append(key)
        else:
            layout["other"].append(key)
    return {name: keys for name, keys in layout.items() if keys}


# ----------------------------------------------------------------------------------------------------
# Plotting
# ----------------------------------------------------------------------------------------------------

def plot_run(run_dir: str | Path, *, out_dir: str | Path | None = None) -> list[Path]:
    """Draw a run's metrics as PNGs in ``out_dir`` (default ``run_dir/plots``); return their paths."""
    path = metrics_path(run_dir)
    series = collect_series(read_events(path))
    out = Path(out_dir) if out_dir is not None else path.parent / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, keys in panel_layout(series).items():
        title = f"{FIGURE_TITLES[name]} - {path.parent.name}"
        figure = build_figure(title, {key: series[key] for key in keys})
        target = out / f"{name}.png"
        figure.savefig(target, dpi=110)
        written.append(target)
    return written


def print_plots(run_dir: str | Path) -> list[Path]:
    """``plot_run(run_dir)``, then one line on stdout saying where the plots are; returns their paths."""
    paths = plot_run(run_dir)
    print(f"treadle: plots in {Path(run_dir) / 'plots'}: {', '.join(p.name for p in paths)}")
    return paths


def build_figure(title: str, series: Series, *, columns: int = 3) -> Figure:
    """One figure with a panel per series, in a grid of up to ``columns`` columns; no empty panels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not series:
        raise ValueError("build_figure needs at least one series")
    columns = min(columns, len(series))
    rows = math.ceil(len(series) / columns)
    figure = Figure(figsize=(4.6 * columns, 3.3 * rows + 0.6), layout="constrained")
    FigureCanvasAgg(figure)  # render with Agg whatever backend the user's matplotlib is set to
    grid = figure.add_gridspec(rows, columns)
    smoothed = False
    for index, (key, (steps, values)) in enumerate(series.items()):
        axes = figure.add_subplot(grid[index // columns, index % columns])
        smoothed |= _draw_panel(axes, key, steps, values)
    if smoothed:
        title += "\n(faint: logged values, solid: moving average)"
    figure.suptitle(title, fontsize=13, fontweight="bold")
    return figure


MARKERS_UP_TO = 30  # with this few points, mark each one
SMOOTH_FROM = 50  # with this many points, a noisy curve also gets a moving average
NOISY = 0.02  # noisy: the median step-to-step change exceeds this fraction of the value range


def _draw_panel(axes, key: str, steps: list[float], values: list[float]) -> bool:
    """Plot one metric; return whether a moving average was drawn over the raw curve."""
    from matplotlib.ticker import MaxNLocator

    smooth = len(values) >= SMOOTH_FROM and _is_noisy(values)
    if smooth:
        axes.plot(steps, values, color="tab:blue", alpha=0.3, linewidth=0.8)
        axes.plot(steps, _moving_average(values, max(3, len(values) // 25)), color="tab:blue",
                  linewidth=1.8)
    else:
        marker = "o" if len(values) <= MARKERS_UP_TO else None
        axes.plot(steps, values, color="tab:blue", marker=marker, markersize=3.5, linewidth=1.4)
    axes.set_title(f"{key}   (last: {values[-1]:.4g})", fontsize=10)
    axes.set_xlabel("step")
    axes.set_ylabel(key)
    axes.grid(True, alpha=0.35)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useOffset=False)
    return smooth


def _is_noisy(values: list[float]) -> bool:
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < 2 or max(finite) == min(finite):
        return False
    changes = sorted(abs(b - a) for a, b in zip(finite, finite[1:]))
    return changes[len(changes) // 2] > NOISY * (max(finite) - min(finite))


def _moving_average(values: list[float], window: int) -> list[float]:
    """Mean over a window centred on each point (narrower at the ends, so no lag); NaNs skipped."""
    half = window // 2
    averaged = []
    for i in range(len(values)):
        near = [v for v in values[max(0, i - half):i + half + 1] if math.isfinite(v)]
        averaged.append(sum(near) / len(near) if near else math.nan)
    return averaged


# ----------------------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------------------

def summarize(run_dir: str | Path) -> str:
    """A plain-text table: per metric its count, first, last, min and max value (NaNs count, but are
    left out of min and max)."""
    path = metrics_path(run_dir)
    events = read_events(path)
    series = collect_series(events)
    steps = [event["step"] for event in events]
    header = f"{path}: {len(events)} events, steps {_fmt(min(steps))}..{_fmt(max(steps))}"
    epochs = [event["epoch"] for event in events if _is_number(event.get("epoch"))]
    if epochs:
        header += f", epochs {_fmt(min(epochs))}..{_fmt(max(epochs))}"
    width = max([len("metric"), *map(len, series)])
    lines = [header, f"{'metric':<{width}}  {'count':>6}  " + "  ".join(
        f"{name:>12}" for name in ("first", "last", "min", "max"))]
    for key, (_, values) in series.items():
        finite = [v for v in values if not math.isnan(v)]
        low, high = (min(finite), max(finite)) if finite else (math.nan, math.nan)
        cells = "  ".join(f"{_fmt(v):>12}" for v in (values[0], values[-1], low, high))
        lines.append(f"{key:<{width}}  {len(values):>6}  {cells}")
    return "\n".join(lines)


def _fmt(value: float) -> str:
    return f"{value:.6g}"
