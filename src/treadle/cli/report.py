"""A run's report: its plots (``treadle.record.plots``), a text summary, and report.html, for one run or an overlay of
several; the ``treadle report`` command's library. Reads the run folder through ``treadle.record.runfiles``.
"""

from __future__ import annotations

import base64
import html
import json
import math
import sys
from pathlib import Path
from typing import Any

from treadle.cli.registry import config_classes
from treadle.record import runfiles
from treadle.record.plots import (
    Series,
    collect_series,
    completions_table,
    is_number,
    metrics_path,
    plot_overlay,
    plot_run,
    read_events,
    run_label,
)

# ----------------------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------------------


def summarize(run_dir: str | Path) -> str:
    """A plain-text table: per metric its count, first, last, min and max value (NaNs count, but are
    left out of min and max)."""
    path = metrics_path(run_dir)
    events = read_events(path)
    rows = summary_rows(collect_series(events))
    width = max([len("metric"), *(len(row[0]) for row in rows)])
    lines = [
        f"{path}: {_span(events)}",
        f"{'metric':<{width}}  {'count':>6}  " + "  ".join(f"{name:>12}" for name in ("first", "last", "min", "max")),
    ]
    for key, count, *values in rows:
        lines.append(f"{key:<{width}}  {count:>6}  " + "  ".join(f"{_fmt(v):>12}" for v in values))
    return "\n".join(lines)


def summary_rows(series: Series) -> list[tuple]:
    """(metric, count, first, last, min, max) per metric; NaNs count, but are left out of min and max."""
    rows = []
    for key, (_, values) in series.items():
        finite = [v for v in values if not math.isnan(v)]
        low, high = (min(finite), max(finite)) if finite else (math.nan, math.nan)
        rows.append((key, len(values), values[0], values[-1], low, high))
    return rows


def _span(events: list[dict[str, Any]]) -> str:
    """ "8 events, steps 1..5, epochs 0.2..1": what a run's metrics.jsonl covers."""
    steps = [event["step"] for event in events]
    text = f"{len(events)} events, steps {_fmt(min(steps))}..{_fmt(max(steps))}"
    epochs = [event["epoch"] for event in events if is_number(event.get("epoch"))]
    return text + (f", epochs {_fmt(min(epochs))}..{_fmt(max(epochs))}" if epochs else "")


# ----------------------------------------------------------------------------------------------------
# Sampled completions and the config
# ----------------------------------------------------------------------------------------------------


def read_completions(run_dir: str | Path) -> list[dict[str, Any]]:
    """The entries of a run's completions.jsonl (GRPO with ``log_completions``); [] when there is none. A line
    cut short by a crash is skipped."""
    return runfiles.read_entries(metrics_path(run_dir).parent / runfiles.COMPLETIONS_FILE)


def read_config(run_dir: str | Path) -> dict[str, Any] | None:
    """The arguments a run was trained with (``training_args.json`` beside metrics.jsonl); None when absent."""
    return runfiles.read_args(metrics_path(run_dir).parent)


# ----------------------------------------------------------------------------------------------------
# report.html: one self-contained page (plots embedded), for one run or an overlay of several
# ----------------------------------------------------------------------------------------------------

COMPLETIONS_SHOWN = 20  # the last N sampled completions report.html lists
STYLE = (
    "body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1500px}"
    "table{border-collapse:collapse;font-size:13px;margin:8px 0 24px}"
    "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}"
    "th{background:#f2f2f2}td.n{text-align:right;font-variant-numeric:tabular-nums}"
    "td.t{white-space:pre-wrap;font-family:monospace;max-width:520px}img{max-width:100%;margin:6px 0}"
    "h2{margin-top:28px;border-bottom:1px solid #ddd}.note{color:#666}"
)


def write_html(run_dir: str | Path, *, plots: list[Path] | None = None, completions: int = COMPLETIONS_SHOWN) -> Path:
    """Write ``report.html`` beside the run's metrics.jsonl: the plots (embedded; ``plots``, or drawn now with
    ``plot_run``), the summary table, the config, and the last ``completions`` sampled completions. Returns its
    path."""
    path = metrics_path(run_dir)
    events = read_events(path)
    plots = plot_run(path) if plots is None else plots
    name = path.parent.name
    rows = [list(row) for row in summary_rows(collect_series(events))]
    sections = [
        f"<p class=note>{html.escape(str(path))}: {_span(events)}</p>",
        "<h2>Plots</h2>" + "".join(_image(p) for p in plots),
        "<h2>Summary</h2>" + _table(["metric", "count", "first", "last", "min", "max"], rows),
    ]
    sections += run_sections(path)
    records = read_completions(path)
    if records:
        shown = records[-completions:]
        sections.append(
            f"<h2>Sampled completions</h2><p class=note>the last {len(shown)} of {len(records)}</p>"
            + _table(*completions_table(shown))
        )
    target = path.parent / "report.html"
    target.write_text(_page(f"treadle run {name}", sections), encoding="utf-8")
    return target


def write_overlay(run_dirs: list[str | Path], out_dir: str | Path) -> Path:
    """Overlay several runs: the plots (``plot_overlay``) and ``report.html`` in ``out_dir`` with the plots, the
    last value of every metric side by side, and the arguments that differ between the runs. Returns its path."""
    out = Path(out_dir)
    plots = plot_overlay(run_dirs, out)
    labels = [run_label(Path(d), run_dirs) for d in run_dirs]
    series = [collect_series(read_events(d)) for d in run_dirs]
    metrics = list(dict.fromkeys(key for s in series for key in s))
    last = [[key, *(s[key][1][-1] if key in s else None for s in series)] for key in metrics]
    configs = [
        {
            **{f"run: {k}": v for k, v in flat_record(runfiles.read_run_info(metrics_path(d).parent)).items()},
            **(read_config(d) or {}),
        }
        for d in run_dirs
    ]  # what made each run, then its arguments
    keys = list(dict.fromkeys(k for c in configs for k in c))
    differ = [
        [k, *(_value(c.get(k, "")) for c in configs)]
        for k in keys
        if len({json.dumps(c.get(k), sort_keys=True, default=str) for c in configs}) > 1
    ]
    sections = [
        "<p class=note>"
        + "<br>".join(html.escape(f"{label}: {Path(d)}") for label, d in zip(labels, run_dirs))
        + "</p>",
        "<h2>Plots</h2>" + "".join(_image(p) for p in plots),
        "<h2>Last values</h2>" + _table(["metric", *labels], last),
        "<h2>What differs between the runs</h2><p class=note>run: model, data, reward functions and LoRA "
        "(run.json); then the arguments (training_args.json)</p>"
        + (
            _table(["setting", *labels], differ)
            if differ
            else "<p class=note>nothing (or no run.json / training_args.json)</p>"
        ),
    ]
    target = out / "report.html"
    target.write_text(_page(f"treadle: {len(labels)} runs", sections), encoding="utf-8")
    return target


def _no_run_json(folder: Path) -> str:
    """Why report.html shows no run.json: there is none, or the one there is cut or unreadable (said on stderr too)."""
    note = runfiles.unreadable_note(folder / runfiles.RUN_FILE)
    if note is None:
        return "no run.json in the run folder"
    print(f"treadle: note: {folder}: {note}; report.html shows no run.json", file=sys.stderr)
    return f"{note}: not shown"


def run_sections(run_dir: str | Path) -> list[str]:
    """report.html's "Run" (run.json: model, data, reward functions, LoRA) and "Config" sections, the arguments that
    differ from the defaults of the run's config class first (training_args.json holds every argument)."""
    folder = metrics_path(run_dir).parent
    record, config = runfiles.read_run_info(folder), read_config(folder)
    sections = [
        "<h2>Run</h2>"
        + (
            _table(["what", "value"], [[k, _value(v)] for k, v in flat_record(record).items()])
            if record
            else f"<p class=note>{html.escape(_no_run_json(folder))}</p>"
        )
    ]
    if not config:
        return sections + ["<h2>Config</h2><p class=note>no training_args.json in the run folder</p>"]
    defaults = config_defaults((record or {}).get("config"), config)
    changed = [
        [k, _value(v), _value(defaults.get(k))]
        for k, v in config.items()
        if k != "output_dir" and defaults is not None and _json(v) != _json(defaults.get(k))
    ]
    name = (record or {}).get("config") or "TrainingArguments"
    head = (
        f"<h3>Set differently from {html.escape(name)}'s defaults</h3>"
        + (_table(["argument", "value", "default"], changed) if changed else "<p class=note>none</p>")
        if defaults is not None
        else f"<p class=note>{html.escape(name)}'s defaults unknown</p>"
    )
    return sections + [
        "<h2>Config</h2>"
        + head
        + "<h3>Every argument</h3>"
        + _table(["argument", "value"], [[k, _value(v)] for k, v in config.items()])
    ]


def config_defaults(config_name: str | None, config: dict[str, Any]) -> dict[str, Any] | None:
    """The arguments a run of ``config_name`` (a treadle config class, e.g. ``GRPOConfig``; None: the base
    ``TrainingArguments``) would hold with no setting changed, as training_args.json writes them; None when the
    class is not treadle's or its defaults cannot be built."""
    config_class = config_classes().get(config_name or "TrainingArguments")
    if config_class is None:
        return None
    try:
        return json.loads(config_class(output_dir=config.get("output_dir") or "run").to_json_string())
    except (ValueError, TypeError, ImportError):
        return None


def flat_record(record: dict[str, Any] | None, prefix: str = "") -> dict[str, Any]:
    """run.json as one level, ``{"model.name_or_path": ..., "peft.r": ...}`` (lists kept whole)."""
    flat: dict[str, Any] = {}
    for key, value in (record or {}).items():
        if isinstance(value, dict):
            flat.update(flat_record(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _page(title: str, sections: list[str]) -> str:
    return (
        f"<!doctype html><html><head><meta charset=utf-8><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>{''.join(sections)}</body></html>\n"
    )


def _image(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<div><img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}"></div>'


def _table(columns: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in columns)
    body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"<td class=n>{_fmt(value)}</td>"
    return f"<td class=t>{html.escape('' if value is None else str(value))}</td>"


def _value(value: Any) -> Any:
    """A config value for a table cell: a number as itself, anything else as it reads in JSON."""
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    return value if numeric or isinstance(value, str) else json.dumps(value)


def _fmt(value: float) -> str:
    return f"{value:.6g}"
