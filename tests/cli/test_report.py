"""treadle.cli.report (the ``treadle report`` command's library): the summary table, its errors, report.html for a
run and for an overlay of several."""

import json
import math

import pytest
from _runs import EVAL_LOSS, GRAD_NORM, LOSS, LR, PNG_SIGNATURE, assert_png, sft_events, write_run

from treadle.cli import report
from treadle.record import plots

# ---------------------------------------------------------------------------------------------- summary


def parse_table(text):
    lines = text.splitlines()
    assert lines[1].split() == ["metric", "count", "first", "last", "min", "max"]
    return {parts[0]: [float(x) for x in parts[1:]] for parts in map(str.split, lines[2:])}


def test_summarize_numbers_match_the_input(tmp_path):
    run = write_run(tmp_path / "run", sft_events())
    text = report.summarize(run)
    assert text.splitlines()[0].endswith("metrics.jsonl: 8 events, steps 1..5, epochs 0.2..1")
    table = parse_table(text)
    for key, values in {
        "loss": LOSS,
        "learning_rate": LR,
        "grad_norm": GRAD_NORM,
        "eval_loss": EVAL_LOSS,
        "train_runtime": [3.5],
    }.items():
        assert table[key] == pytest.approx([len(values), values[0], values[-1], min(values), max(values)], rel=1e-5), (
            key
        )
    assert list(table) == [
        "loss",
        "learning_rate",
        "grad_norm",
        "eval_loss",
        "train_loss",
        "train_runtime",
        "train_samples_per_second",
    ]


def test_summarize_ignores_nan_in_min_and_max(tmp_path):
    run = write_run(
        tmp_path / "run", [{"step": 1, "loss": 2.0}, {"step": 2, "loss": math.nan}, {"step": 3, "loss": 1.0}]
    )
    text = report.summarize(run)
    assert text.splitlines()[0].endswith("3 events, steps 1..3")  # no epochs logged, none shown
    count, first, last, low, high = parse_table(text)["loss"]
    assert (count, first, last, low, high) == (3, 2.0, 1.0, 1.0, 2.0)


# ---------------------------------------------------------------------------------------------- errors


def test_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        plots.plot_run(tmp_path / "nope")


def test_folder_without_metrics(tmp_path):
    with pytest.raises(ValueError, match="metrics.jsonl not found"):
        report.summarize(tmp_path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_metrics(tmp_path, content):
    (tmp_path / "metrics.jsonl").write_text(content)
    with pytest.raises(ValueError, match=r"metrics\.jsonl is empty"):
        plots.plot_run(tmp_path)


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"step": 3, "loss": 0.5', "corrupt line, not valid JSON"),
        ("[1, 2, 3]", "expected a JSON object"),
        ('{"loss": 0.5}', "event has no numeric 'step'"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path, bad_line, message):
    write_run(tmp_path, sft_events()[:2], extra_lines=[bad_line])
    for call in (plots.plot_run, report.summarize):
        with pytest.raises(ValueError) as error:
            call(tmp_path)
        assert f"{tmp_path / 'metrics.jsonl'}:3: {message}" in str(error.value)
    assert not (tmp_path / "plots").exists()


# ---------------------------------------------------------------------------------------------- report.html


def completion_entries():
    return [
        {
            "step": s,
            "prompt": f"{s}+1=<b>",
            "completion": str(s + 1),
            "rewards": {"exact": 1.0, "len": None},
            "advantage": 0.5 - s,
        }
        for s in range(3)
    ]


def write_full_run(run_dir, learning_rate=1e-3, loss_scale=1.0):
    events = [{**e, "loss": e["loss"] * loss_scale} if "loss" in e else e for e in sft_events()]
    write_run(run_dir, events)
    (run_dir / "training_args.json").write_text(json.dumps({"learning_rate": learning_rate, "seed": 42}))
    (run_dir / "completions.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in completion_entries()) + '{"step": 3, "prom'
    )  # a line cut by a crash: skipped
    return run_dir


def embedded_pngs(page):
    import base64
    import re

    return [base64.b64decode(data) for data in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]


def test_completions_table_has_a_column_per_reward():
    records = completion_entries()[:1] + [
        {
            "step": 1,
            "prompt": [{"role": "user", "content": "hi"}],
            "completion": "x",
            "rewards": {"len": 2.0},
            "advantage": -0.5,
        }
    ]
    columns, rows = plots.completions_table(records)
    assert columns == ["step", "prompt", "completion", "exact", "len", "advantage"]
    assert rows == [
        [0, "0+1=<b>", "1", 1.0, None, 0.5],
        [1, '[{"role": "user", "content": "hi"}]', "x", None, 2.0, -0.5],
    ]


def test_report_html_is_one_self_contained_page(tmp_path):
    run = write_full_run(tmp_path / "run")
    path = report.write_html(run, completions=2)
    page = path.read_text()
    assert path == run / "report.html" and page.startswith("<!doctype html>")
    assert [png[:8] for png in embedded_pngs(page)] == [PNG_SIGNATURE]  # training.png, inline
    assert "http" not in page and "<script" not in page  # nothing fetched, nothing run
    assert "<tr><td class=t>loss</td><td class=n>5</td><td class=n>2.5</td><td class=n>0.5</td>" in page
    assert "<tr><td class=t>learning_rate</td><td class=n>0.001</td></tr>" in page  # the config
    assert "the last 2 of 3" in page and "2+1=&lt;b&gt;" in page and "0+1=" not in page  # escaped, last N only
    assert "<th>exact</th><th>len</th><th>advantage</th>" in page


def test_report_html_without_config_or_completions_says_so(tmp_path):
    run = write_run(tmp_path / "run", sft_events())
    page = report.write_html(run).read_text()
    assert "no training_args.json in the run folder" in page and "Sampled completions" not in page


def test_overlay_draws_each_run_in_its_own_colour(tmp_path):
    a = write_full_run(tmp_path / "a", learning_rate=1e-3)
    b = write_full_run(tmp_path / "b", learning_rate=3e-4, loss_scale=2.0)
    paths = report.plot_overlay([a, b], tmp_path / "compare")
    assert paths == [tmp_path / "compare" / "training.png"]
    assert_png(paths[0])
    series = {run: plots.collect_series(plots.read_events(tmp_path / run)) for run in ("a", "b")}
    panels = {"loss": {f"{run}: {key}": series[run][key] for run in ("a", "b") for key in ("loss", "eval_loss")}}
    [axes] = plots.build_figure("t", panels, runs=["a", "b"]).axes
    lines = {line.get_label(): line for line in axes.get_lines()}
    assert list(lines["b: loss"].get_ydata()) == [2 * v for v in LOSS]
    assert lines["a: loss"].get_color() == lines["a: eval_loss"].get_color() != lines["b: loss"].get_color()
    assert lines["b: eval_loss"].get_linestyle() == "--"


def test_overlay_page_lists_last_values_and_the_arguments_that_differ(tmp_path):
    a = write_full_run(tmp_path / "x" / "run", learning_rate=1e-3)
    b = write_full_run(tmp_path / "y" / "run", learning_rate=3e-4, loss_scale=2.0)  # same name: parent shown
    page = report.write_overlay([a, b], tmp_path / "compare").read_text()
    assert len(embedded_pngs(page)) == 1
    assert "<th>metric</th><th>x/run</th><th>y/run</th>" in page
    assert "<tr><td class=t>loss</td><td class=n>0.5</td><td class=n>1</td></tr>" in page
    assert "<tr><td class=t>learning_rate</td><td class=n>0.001</td><td class=n>0.0003</td></tr>" in page
    assert "<td class=t>seed</td>" not in page  # the same in both runs


def test_an_overlay_names_a_metric_unchanged_in_every_run_once():
    steps = [1, 2]
    panels = {
        "kl": {"a: kl": (steps, [0.0, 0.0]), "b: kl": (steps, [0.0, 0.0])},
        "lr": {"a: lr": (steps, [1.0, 1.0]), "b: lr": (steps, [2.0, 2.0])},
    }
    figure = plots.build_figure("t", panels, runs=["a", "b"])
    text = " ".join(figure.get_supxlabel().split())
    assert text == "unchanged over the run: kl = 0 (2 logs, every run); a: lr = 1 (2 logs); b: lr = 2 (2 logs)"


def test_a_metric_equal_to_an_earlier_one_shares_its_panel():
    """One reward function: its greedy accuracy equals the total's at every step, so it is drawn in that panel;
    a metric equal only at some steps, a constant one, and a training metric equal to an evaluation one keep
    their own places."""
    events = [
        {
            "step": s,
            "eval_greedy/accuracy": a,
            "eval_greedy/rewards/f/accuracy": a,
            "eval_pass@1": p,
            "eval_other": a if s else 0.9,
            "eval_const": 0.5,
            "frac": a,
        }
        for s, a, p in [(0, 0.2, 0.1), (10, 0.4, 0.3), (20, 0.5, 0.35)]
    ]
    layout = plots.panel_layout(plots.collect_series(events))
    assert layout["eval"]["eval_greedy/accuracy"] == ["eval_greedy/accuracy", "eval_greedy/rewards/f/accuracy"]
    assert {"eval_pass@1", "eval_other", "eval_const"} <= set(layout["eval"])
    assert "eval_greedy/rewards/f/accuracy" not in layout["eval"]
    assert [keys for panels in layout.values() for name, keys in panels.items() if name == "frac"] == [["frac"]]
