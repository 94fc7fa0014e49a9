"""treadle.record.plots: reading metrics.jsonl, the panel layout, the PNGs (one run and overlays) and the completions
table."""

import pytest
from _runs import EVAL_LOSS, LOSS, assert_png, sft_events, write_run

from treadle.record import plots

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
    paths = plots.plot_run(run)
    assert paths == [run / "plots" / "training.png", run / "plots" / "eval.png"]
    assert sorted(p.name for p in (run / "plots").iterdir()) == ["eval.png", "training.png"]
    for path in paths:
        assert_png(path)


def test_print_plots_draws_them_and_says_where(tmp_path, capsys):
    run = write_run(tmp_path / "run", sft_events())
    assert plots.print_plots(run) == [run / "plots" / "training.png"]
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
    paths = plots.plot_run(run / "metrics.jsonl", out_dir=tmp_path / "elsewhere")
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
