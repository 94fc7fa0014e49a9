"""Plots (PNG) of a run, drawn from ``output_dir/metrics.jsonl`` (read through ``treadle.record.runfiles``).

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
and appear in ``treadle.cli.report.summarize``. ``completions_table`` is the table trackers and report.html show of
GRPO's sampled completions.

matplotlib is imported inside the plotting functions (it costs ~0.5 s and only a plot needs it), and only its
object-oriented API with the Agg canvas is used, so nothing here touches pyplot's global state or needs a
display.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from treadle.record import runfiles

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from matplotlib.figure import Figure

TRAINING_KEYS = ("loss", "learning_rate", "grad_norm", "mean_token_accuracy")
RL_PREFIXES = ("reward", "frac_reward", "kl", "entropy", "clip_ratio", "completions/", "logps/", "logits/")
SUMMARY_PREFIXES = ("train_", "total_flos")  # one value at the end of a run: a table row, not a plot
NOT_METRICS = ("step", "epoch")  # the axes of every series, not series themselves
HEALTH_MARKERS = ("health/warning/", "health/stop/")  # GRPO's health events: markers on every panel, not series
FIGURE_TITLES = {
    "training": "Training",
    "rewards": "Rewards and policy statistics",
    "eval": "Evaluation",
    "other": "Other metrics",
}

Series = dict[str, tuple[list[float], list[float]]]  # metric -> (steps, values)


def metrics_path(run_dir: str | Path) -> Path:
    """The metrics file of a run folder (or the file itself); ValueError when it is not there."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / runfiles.METRICS_FILE
    elif not path.exists():
        raise ValueError(f"run folder {path} does not exist")
    if not path.is_file():
        raise ValueError(f"{path} not found: is {run_dir} the output_dir of a treadle run?")
    return path


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """The log events of a run, in file order (``runfiles.read_entries``: a line cut by a crash is dropped).

    Raises ValueError naming the file (and the line, ``file:line``) when the folder or file is missing,
    the file holds no events, or a line is not a JSON object with a numeric ``step``.
    """
    path = metrics_path(run_dir)
    events = runfiles.read_entries(path)
    if not events:
        raise ValueError(f"{path} is empty: the run logged no events")
    return events


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def collect_series(events: list[dict[str, Any]]) -> Series:
    """Every numeric metric as (steps, values), keys in order of first appearance."""
    series: Series = {}
    for event in events:
        for key, value in event.items():
            if key in NOT_METRICS or not is_number(value):
                continue
            steps, values = series.setdefault(key, ([], []))
            steps.append(event["step"])
            values.append(float(value))
    return series


def panel_layout(series: Series) -> dict[str, dict[str, list[str]]]:
    """Figure name -> panel name -> the metrics drawn in that panel; figures without metrics are left out.

    A panel is named after its metric and also draws, dashed, the evaluation of the same metric (``eval_loss``
    over ``loss``). GRPO's reward panel draws the total (``reward``) and each reward function's mean
    (``rewards/<fn>/mean``), its ``reward_std`` panel each function's std. A metric that changes over the run
    and equals an earlier one at every step (one reward function: ``eval_greedy/rewards/<fn>/accuracy`` and
    ``eval_greedy/accuracy``) is drawn in that one's panel, not in a panel of its own.
    """
    layout: dict[str, dict[str, list[str]]] = {name: {} for name in FIGURE_TITLES}
    grouped = {}  # rewards/<fn>/mean -> "reward", rewards/<fn>/std -> "reward_std" (when the total is logged)
    for key in series:
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "rewards" and parts[2] in ("mean", "std"):
            total = "reward" if parts[2] == "mean" else "reward_std"
            if total in series:
                grouped[key] = total
    overlaid = {f"eval_{key}" for key in series if not key.startswith("eval_") and f"eval_{key}" in series}
    grouped.update(_same_as_earlier(series, skip=grouped.keys() | overlaid))
    first = [k for k in (*TRAINING_KEYS, "reward", "reward_std") if k in series]  # the panels people look at first
    for key in first + [k for k in series if k not in first]:
        if key.startswith((*SUMMARY_PREFIXES, *HEALTH_MARKERS)) or key in overlaid:
            continue
        figure = (
            "training"
            if key in TRAINING_KEYS
            else "eval"
            if key.startswith("eval_")
            else "rewards"
            if key.startswith(RL_PREFIXES)
            else "other"
        )
        panel = layout[figure].setdefault(grouped.get(key, key), [])
        panel += [key] + ([f"eval_{key}"] if f"eval_{key}" in overlaid else [])
    for panels in layout.values():  # a total drawn before its functions, whatever order they came in
        for name, keys in panels.items():
            keys.sort(key=lambda k: k.removeprefix("eval_") != name)
    return {name: panels for name, panels in layout.items() if panels}


def _same_as_earlier(series: Series, skip) -> dict[str, str]:
    """{key: the first earlier metric with the same steps and values (its panel)}, for metrics that change and
    are not in ``skip`` (already drawn in another metric's panel)."""
    first: dict[tuple, str] = {}
    out = {}
    for key, line in series.items():
        if key in skip or key.startswith(SUMMARY_PREFIXES) or len(line[0]) < 2 or _is_constant(line):
            continue
        signature = (key.startswith("eval_"), tuple(line[0]), tuple(line[1]))  # training and eval stay apart
        if signature in first:
            out[key] = first[signature]
        else:
            first[signature] = key
    return out


def plot_run(run_dir: str | Path, *, out_dir: str | Path | None = None) -> list[Path]:
    """Draw a run's metrics as PNGs in ``out_dir`` (default ``run_dir/plots``); return their paths."""
    path = metrics_path(run_dir)
    series = collect_series(read_events(path))
    markers = health_markers(series)
    out = Path(out_dir) if out_dir is not None else path.parent / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, panels in panel_layout(series).items():
        title = f"{FIGURE_TITLES[name]} - {path.parent.name}"
        figure = build_figure(
            title, {panel: {key: series[key] for key in keys} for panel, keys in panels.items()}, markers=markers
        )
        target = out / f"{name}.png"
        figure.savefig(target, dpi=110)
        written.append(target)
    return written


def print_plots(run_dir: str | Path) -> list[Path]:
    """``plot_run(run_dir)``, then one line on stdout saying where the plots are; returns their paths."""
    paths = plot_run(run_dir)
    print(f"treadle: plots in {Path(run_dir) / 'plots'}: {', '.join(p.name for p in paths)}")
    return paths


def plot_overlay(run_dirs: list[str | Path], out_dir: str | Path) -> list[Path]:
    """Draw several runs in the same panels (one colour per run, named by its folder) as PNGs in ``out_dir``;
    return their paths. Each figure and panel is there when any run has its metrics."""
    runs = {run_label(Path(d), run_dirs): collect_series(read_events(d)) for d in run_dirs}
    layouts = {label: panel_layout(series) for label, series in runs.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in FIGURE_TITLES:
        panels: dict[str, Series] = {}
        for label, layout in layouts.items():
            for panel, keys in layout.get(name, {}).items():
                lines = panels.setdefault(panel, {})
                lines.update({f"{label}: {key}": runs[label][key] for key in keys})
        if panels:
            figure = build_figure(f"{FIGURE_TITLES[name]} - {len(runs)} runs", panels, runs=list(runs))
            figure.savefig(out / f"{name}.png", dpi=110)
            written.append(out / f"{name}.png")
    return written


def run_label(path: Path, run_dirs) -> str:
    """A run's name in an overlay: its folder's name, with the parent's when two runs share a name."""
    names = [Path(d).resolve().name for d in run_dirs]
    resolved = path.resolve()
    return resolved.name if names.count(resolved.name) == 1 else f"{resolved.parent.name}/{resolved.name}"


def health_markers(series: Series) -> list[tuple[float, str]]:
    """(step, "warning: <check>" or "stop: <check>") of each health event a run logged (GRPO's health checks)."""
    return sorted(
        (step, f"{prefix.split('/')[1]}: {key[len(prefix) :]}")
        for key, (steps, _) in series.items()
        for prefix in HEALTH_MARKERS
        if key.startswith(prefix)
        for step in steps
    )


def build_figure(
    title: str,
    panels: dict[str, Series],
    *,
    columns: int = 3,
    runs: list[str] | None = None,
    markers: list[tuple[float, str]] | None = None,
) -> Figure:
    """One figure with a panel per entry of ``panels`` (panel name -> the series drawn in it), in a grid of up to
    ``columns`` columns; no empty panels. A panel whose every series never changed is not drawn: it becomes a
    line of text under the panels ("unchanged: clip_ratio = 0 (12 logs)"). Evaluation series (``eval_*``) are
    dashed; with ``runs`` (an overlay; series labelled ``"<run>: <metric>"``) each run has one colour."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not panels:
        raise ValueError("build_figure needs at least one panel")
    drawn = {name: lines for name, lines in panels.items() if not all(map(_is_constant, lines.values()))}
    unchanged = _unchanged_text(
        [
            (label, values)
            for name, lines in panels.items()
            if name not in drawn
            for label, (_, values) in lines.items()
        ],
        runs,
    )
    columns = max(1, min(columns, len(drawn)))
    rows = math.ceil(len(drawn) / columns)
    figure = Figure(
        figsize=(4.6 * columns, 3.3 * rows + 0.6 + 0.25 * len(unchanged) // 3)
        if drawn
        else (9.0, 1.2 + 0.25 * len(unchanged) // 2),
        layout="constrained",
    )
    FigureCanvasAgg(figure)  # render with Agg whatever backend the user's matplotlib is set to
    smoothed = _draw_panels(figure, drawn, rows, columns, runs, markers) if drawn else False
    if unchanged:
        figure.supxlabel(
            _wrap("unchanged over the run: " + ";  ".join(unchanged), 60 * columns if drawn else 120),
            fontsize=9,
            color="dimgray",
        )
    if smoothed:
        title += "\n(faint: logged values, solid: moving average)"
    figure.suptitle(title, fontsize=13, fontweight="bold")
    return figure


def _draw_panels(
    figure,
    drawn: dict[str, Series],
    rows: int,
    columns: int,
    runs: list[str] | None,
    markers: list[tuple[float, str]] | None,
) -> bool:
    """Draw each of ``drawn``'s panels in a ``rows`` x ``columns`` grid of ``figure``, with the health
    ``markers`` on each; return whether any panel drew a moving average."""
    smoothed = False
    grid = figure.add_gridspec(rows, columns)
    for index, (name, lines) in enumerate(drawn.items()):
        axes = figure.add_subplot(grid[index // columns, index % columns])
        smoothed |= _draw_panel(axes, name, lines, runs)
        _draw_markers(axes, markers)
    return smoothed


def _draw_markers(axes, markers: list[tuple[float, str]] | None) -> None:
    """Health warnings (orange) and stops (red): a dotted vertical line at their step, labelled."""
    for step, label in markers or ():
        colour = "tab:red" if label.startswith("stop") else "tab:orange"
        axes.axvline(step, color=colour, linestyle=":", linewidth=1.2, zorder=0)
        axes.annotate(
            label,
            (step, 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            fontsize=6,
            color=colour,
            ha="right",
            va="top",
        )


def _is_constant(line: tuple[list[float], list[float]]) -> bool:
    values = line[1]
    return all(v == values[0] or (math.isnan(v) and math.isnan(values[0])) for v in values)


def _unchanged_text(lines: list[tuple[str, list[float]]], runs: list[str] | None) -> list[str]:
    """ "kl = 0 (12 logs)" per unchanged series; in an overlay, one "(..., every run)" for a metric the same in all."""
    texts = []
    for label, values in lines:
        metric, shown = _metric(label, runs), f"{values[0]:.4g} ({len(values)} log{'s' if len(values) > 1 else ''}"
        same = [v for lab, v in lines if _metric(lab, runs) == metric and v[0] == values[0] and len(v) == len(values)]
        if runs and len(same) == len(runs):
            text = f"{metric} = {shown}, every run)"
        else:
            text = f"{label} = {shown})"
        texts += [text] if text not in texts else []
    return texts


def _wrap(text: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


MARKERS_UP_TO = 30  # with this few points, mark each one
SMOOTH_FROM = 50  # with this many points, a noisy curve also gets a moving average
NOISY = 0.02  # noisy: the median step-to-step change exceeds this fraction of the value range


def _draw_panel(axes, name: str, lines: Series, runs: list[str] | None) -> bool:
    """Plot the series of one panel; return whether a moving average was drawn over a raw curve."""
    smoothed = False
    bases = list(dict.fromkeys(_base(label, runs) for label in lines))
    for label, (steps, values) in lines.items():
        colour, style, total = _line_look(label, name, bases, runs)
        if len(values) >= SMOOTH_FROM and _is_noisy(values):
            axes.plot(steps, values, color=colour, alpha=0.3, linewidth=0.8, linestyle=style)
            axes.plot(
                steps,
                _moving_average(values, max(3, len(values) // 25)),
                color=colour,
                linewidth=1.8,
                linestyle=style,
                label=label,
            )
            smoothed = True
        else:
            marker = "o" if len(values) <= MARKERS_UP_TO else None
            axes.plot(
                steps,
                values,
                color=colour,
                marker=None if total else marker,
                markersize=3.5,
                linewidth=5 if total else 1.4,
                alpha=0.6 if total else 1.0,
                linestyle=style,
                label=f"{label} (total)" if total else label,
                zorder=1 if total else 2,
            )
    _finish_axes(axes, name, lines)
    return smoothed


def _line_look(label: str, name: str, bases: list[str], runs: list[str] | None) -> tuple[str, Any, bool]:
    """(colour, line style, whether it is the panel's total) of the line ``label`` in panel ``name``, whose
    lines draw the metrics ``bases``."""
    colours = [f"C{i}" for i in range(10)]
    run = label.split(": ", 1)[0] if runs else None
    evaluation, base = _metric(label, runs).startswith("eval_"), _base(label, runs)
    # a lone training / eval pair in two colours; else one colour per metric, and a total (GRPO's reward) a wide
    # grey band under the functions' lines, so that a function equal to the total does not hide it
    index = runs.index(run) if runs else bases.index(base) + (evaluation and len(bases) == 1)
    total = not runs and len(bases) > 1 and base == name
    colour = "0.6" if total else colours[(index - (len(bases) > 1 and not runs)) % len(colours)]
    style = "--" if evaluation else "-"
    if runs and len(bases) > 1:  # several metrics of each run in one panel: each its own line style
        style = ["-", "--", ":", "-."][bases.index(base) % 4] if style == "-" else (0, (1, 3))
    return colour, style, total


def _finish_axes(axes, name: str, lines: Series) -> None:
    """Title (with the last value when the panel has one line), axis labels, grid, integer steps, legend."""
    from matplotlib.ticker import MaxNLocator

    last = next(iter(lines.values()))[1][-1]
    axes.set_title(f"{name}   (last: {last:.4g})" if len(lines) == 1 else name, fontsize=10)
    axes.set_xlabel("step")
    axes.set_ylabel(name)
    axes.grid(True, alpha=0.35)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useOffset=False)
    if len(lines) > 1:
        axes.legend(fontsize=7, loc="best")


def _metric(label: str, runs: list[str] | None) -> str:
    """The metric a line label names (an overlay's labels are "<run>: <metric>")."""
    return label.split(": ", 1)[1] if runs else label


def _base(label: str, runs: list[str] | None) -> str:
    """The metric a line draws, its evaluation and training series counted as one."""
    return _metric(label, runs).removeprefix("eval_")


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
        near = [v for v in values[max(0, i - half) : i + half + 1] if math.isfinite(v)]
        averaged.append(sum(near) / len(near) if near else math.nan)
    return averaged


def completions_table(entries: list[dict[str, Any]]) -> tuple[list[str], list[list]]:
    """(columns, rows) of completions.jsonl entries: step, prompt, completion, one column per reward function,
    advantage. A chat prompt or completion (a list of messages) is written as JSON."""
    rewards = list(dict.fromkeys(name for r in entries for name in r.get("rewards", {})))
    columns = ["step", "prompt", "completion", *rewards, "advantage"]
    rows = [
        [
            r.get("step"),
            _text(r.get("prompt")),
            _text(r.get("completion")),
            *(r.get("rewards", {}).get(name) for name in rewards),
            r.get("advantage"),
        ]
        for r in entries
    ]
    return columns, rows


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
