"""Tests for treadle.record.report: reading metrics.jsonl, the panel layout, the PNGs and the summary table."""

import json
import math

import pytest

from treadle.record import plots, report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# An SFT-like run: five training events, two evaluations (steps 2 and 4), a final summary event,
# and values the report must skip (a string, a bool, a list).
LOSS = [2.5, 1.75, 1.0, 0.625, 0.5]
LR = [1e-3, 8e-4, 6e-4, 4e-4, 2e-4]
GRAD_NORM = [3.0, 2.0, 4.0, 1.5, 1.0]
EVAL_LOSS = [1.5, 0.75]


def sft_events():
    events = []
    for i in range(5):
        step = i + 1
        events.append(
            {
                "step": step,
                "epoch": step / 5,
                "loss": LOSS[i],
                "learning_rate": LR[i],
                "grad_norm": GRAD_NORM[i],
                "note": "warmup",
                "is_best": True,
                "hist": [1, 2],
            }
        )
        if step in (2, 4):
            events.append({"step": step, "epoch": step / 5, "eval_loss": EVAL_LOSS[step // 2 - 1]})
    events.append(
        {"step": 5, "epoch": 1.0, "train_loss": 1.275, "train_runtime": 3.5, "train_samples_per_second": 91.4}
    )
    return events


def write_run(run_dir, events, *, extra_lines=()):
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(e) for e in events] + list(extra_lines)
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return run_dir


def assert_png(path):
    from matplotlib.image import imread

    assert path.is_file()
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    height, width = imread(path).shape[:2]
    assert width > 300 and height > 200


# ---------------------------------------------------------------------------------------------- reading


def test_series_use_only_the_events_that_have_the_key():
    series = plots.collect_series(sft_events())
    assert series["loss"] == ([1, 2, 3, 4, 5], LOSS)
    assert series["eval_loss"] == ([2, 4], EVAL_LOSS)
    assert series["train_runtime"] == ([5], [3.5])
    assert not {"note", "is_best", "hist", "step", "epoch"} & set(series)


def test_panel_layout_sft_draws_eval_loss_over_the_training_loss():
    layout = plots.panel_layout(plots.collect_series(sft_events()))
    assert layout == {
        "training": {"loss": ["loss", "eval_loss"], "learning_rate": ["learning_rate"], "grad_norm": ["grad_norm"]}
    }


def test_panel_layout_grpo_and_dpo_keys():
    grpo = {
        "step": 1,
        "loss": 0.1,
        "reward": 0.5,
        "reward_std": 0.2,
        "kl": 0.01,
        "rewards/addition_reward/mean": 0.5,
        "completions/mean_length": 3.0,
        "entropy": 1.2,
        "clip_ratio/region_mean": 0.0,
        "num_tokens": 640,
    }
    dpo = {
        "step": 2,
        "rewards/chosen": 0.3,
        "rewards/rejected": -0.2,
        "rewards/accuracies": 0.75,
        "rewards/margins": 0.5,
        "logps/chosen": -3.0,
        "logps/rejected": -4.0,
        "eval_reward": 0.6,
    }
    layout = plots.panel_layout(plots.collect_series([grpo, dpo]))
    one = lambda *keys: {key: [key] for key in keys}  # noqa: E731 - a panel per metric
    assert layout == {
        "training": {"loss": ["loss"]},
        # the reward panel: the total (and its evaluation, dashed), then each reward function's mean
        "rewards": {
            "reward": ["reward", "eval_reward", "rewards/addition_reward/mean"],
            **one(
                "reward_std",
                "kl",
                "completions/mean_length",
                "entropy",
                "clip_ratio/region_mean",
                "rewards/chosen",
                "rewards/rejected",
                "rewards/accuracies",
                "rewards/margins",
                "logps/chosen",
                "logps/rejected",
            ),
        },
        "other": {"num_tokens": ["num_tokens"]},
    }


def test_grpo_reward_panel_holds_every_function_and_the_total_even_when_they_come_first():
    events = [
        {
            "step": 1,
            "rewards/b/mean": 1.0,
            "rewards/a/mean": 0.0,
            "rewards/a/std": 0.5,
            "reward": 1.0,
            "reward_std": 0.5,
            "eval_rewards/a/mean": 0.2,
        }
    ]
    layout = plots.panel_layout(plots.collect_series(events))
    assert layout == {
        "rewards": {
            "reward": ["reward", "rewards/b/mean", "rewards/a/mean", "eval_rewards/a/mean"],
            "reward_std": ["reward_std", "rewards/a/std"],
        }
    }


# ---------------------------------------------------------------------------------------------- plots


def test_plot_run_writes_the_expected_pngs(tmp_path):
    run = write_run(tmp_path / "run", sft_events() + [{"step": 5, "eval_accuracy": a} for a in (0.5, 0.75)])
    paths = report.plot_run(run)
    assert paths == [run / "plots" / "training.png", run / "plots" / "eval.png"]
    assert sorted(p.name for p in (run / "plots").iterdir()) == ["eval.png", "training.png"]
    for path in paths:
        assert_png(path)


def test_print_plots_draws_them_and_says_where(tmp_path, capsys):
    run = write_run(tmp_path / "run", sft_events())
    assert report.print_plots(run) == [run / "plots" / "training.png"]
    assert capsys.readouterr().out == f"treadle: plots in {run / 'plots'}: training.png\n"


def test_eval_loss_is_drawn_dashed_in_the_loss_panel(tmp_path):
    series = plots.collect_series(sft_events())
    figure = plots.build_figure("t", {"loss": {k: series[k] for k in ("loss", "eval_loss")}})
    [axes] = figure.axes
    train, evaluation = axes.get_lines()
    assert list(train.get_ydata()) == LOSS and list(evaluation.get_ydata()) == EVAL_LOSS
    assert list(evaluation.get_xdata()) == [2, 4] and evaluation.get_linestyle() == "--"
    assert train.get_color() != evaluation.get_color()  # a lone pair: two colours
    # with several metrics in a panel (GRPO's rewards), each metric has one colour, its evaluation dashed
    figure = plots.build_figure(
        "t",
        {
            "reward": {
                "reward": ([1, 2], [0.0, 1.0]),
                "eval_reward": ([2], [0.5]),
                "rewards/a/mean": ([1, 2], [1.0, 0.0]),
            }
        },
    )
    total, total_eval, function = figure.axes[0].get_lines()
    assert total.get_color() == total_eval.get_color() == "0.6" != function.get_color()
    assert total.get_linewidth() > function.get_linewidth() and total.get_zorder() < function.get_zorder()
    assert [t.get_text() for t in axes.get_legend().get_texts()] == ["loss", "eval_loss"]


def test_a_metric_that_never_changed_is_a_line_of_text_not_a_panel():
    steps = [1, 2, 3]
    panels = {
        "loss": {"loss": (steps, [3.0, 2.0, 1.0])},
        "clip_ratio/low_mean": {"clip_ratio/low_mean": (steps, [0.0] * 3)},
        "kl": {"kl": (steps, [0.25] * 3)},
    }
    figure = plots.build_figure("t", panels)
    assert [a.get_ylabel() for a in figure.axes] == ["loss"]
    text = " ".join(figure.get_supxlabel().split())  # wrapped to the figure's width
    assert text == "unchanged over the run: clip_ratio/low_mean = 0 (3 logs); kl = 0.25 (3 logs)"
    # a figure of unchanged metrics only is that text alone
    figure = plots.build_figure("t", {"kl": {"kl": (steps, [0.25] * 3)}})
    assert figure.axes == [] and "kl = 0.25 (3 logs)" in figure.get_supxlabel()


def test_plot_run_out_dir_and_every_figure(tmp_path):
    events = sft_events() + [
        {"step": s, "reward": 0.5 * s, "kl": 0.1 * s, "num_tokens": 100 * s, "eval_accuracy": 0.1 * s} for s in (6, 7)
    ]
    run = write_run(tmp_path / "run", events)
    paths = report.plot_run(run / "metrics.jsonl", out_dir=tmp_path / "elsewhere")
    assert [p.name for p in paths] == ["training.png", "rewards.png", "eval.png", "other.png"]
    assert all(p.parent == tmp_path / "elsewhere" for p in paths)
    for path in paths:
        assert_png(path)
    assert not (run / "plots").exists()


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7])
def test_figure_has_one_labelled_panel_per_series_and_the_right_data(count):
    series = {f"metric_{k}": ([1, 2, 4], [float(k), k + 0.5, k - 1.0]) for k in range(count)}
    figure = plots.build_figure("title", {key: {key: line} for key, line in series.items()})
    assert len(figure.axes) == count  # no empty panels in the grid
    for axes, (key, (steps, values)) in zip(figure.axes, series.items()):
        assert axes.get_xlabel() == "step" and axes.get_ylabel() == key
        assert axes.get_title().startswith(key)
        line = axes.get_lines()[-1]
        assert list(line.get_xdata()) == steps and list(line.get_ydata()) == values
        assert line.get_marker() == "o"  # few points: each one marked


def test_long_noisy_series_get_a_centred_moving_average():
    steps = list(range(100))
    values = [float(s % 2) for s in steps]  # alternating 0, 1: as noisy as it gets
    figure = plots.build_figure("t", {"loss": {"loss": (steps, values)}})
    raw, smooth = figure.axes[0].get_lines()
    assert list(raw.get_ydata()) == values
    window = 100 // 25  # 4 -> 2 points either side, fewer at the ends
    for i in (0, 1, 50, 99):
        near = values[max(0, i - window // 2) : i + window // 2 + 1]
        assert smooth.get_ydata()[i] == pytest.approx(sum(near) / len(near))
    # a smooth series of the same length (a learning-rate schedule) is drawn once, unsmoothed
    figure = plots.build_figure("t", {"learning_rate": {"learning_rate": (steps, [1 - s / 100 for s in steps])}})
    assert len(figure.axes[0].get_lines()) == 1


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
        report.plot_run(tmp_path / "nope")


def test_folder_without_metrics(tmp_path):
    with pytest.raises(ValueError, match="metrics.jsonl not found"):
        report.summarize(tmp_path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_metrics(tmp_path, content):
    (tmp_path / "metrics.jsonl").write_text(content)
    with pytest.raises(ValueError, match=r"metrics\.jsonl is empty"):
        report.plot_run(tmp_path)


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
    for call in (report.plot_run, report.summarize):
        with pytest.raises(ValueError) as error:
            call(tmp_path)
        assert f"{tmp_path / 'metrics.jsonl'}:3: {message}" in str(error.value)
    assert not (tmp_path / "plots").exists()


# ---------------------------------------------------------------------------------------------- report.html


def completion_records():
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
        "".join(json.dumps(r) + "\n" for r in completion_records()) + '{"step": 3, "prom'
    )  # a line cut by a crash: skipped
    return run_dir


def embedded_pngs(page):
    import base64
    import re

    return [base64.b64decode(data) for data in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]


def test_completions_table_has_a_column_per_reward():
    records = completion_records()[:1] + [
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
