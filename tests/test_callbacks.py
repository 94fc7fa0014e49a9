"""Callbacks: the exact event order, every built-in through a tiny run, transformers compatibility."""

import json
import os
import sys

import pytest
import torch
from _factories import lm_rows, tiny_llama

from treadle import EarlyStoppingCallback, Trainer, TrainerCallback, TrainingArguments
from treadle.callbacks import EVENTS, FlowCallback, MetricsFileCallback, TrainerState
from treadle.console import PrinterCallback, ProgressCallback, run_summary, watched_keys
from treadle.trainers.grpo import GRPOTrainer


def args_for(tmp_path, **kw):
    defaults = dict(output_dir=str(tmp_path), disable_tqdm=True, save_strategy="no", learning_rate=1e-3)
    return TrainingArguments(**{**defaults, **kw})


class Recorder(TrainerCallback):
    """Records every event with the step it fired at."""

    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if name in EVENTS:
            events = object.__getattribute__(self, "events")
            return lambda args, state, control, **kw: events.append((name, state.global_step))
        return object.__getattribute__(self, name)


def test_event_sequence_of_two_epochs_with_accumulation_and_evaluation(tmp_path):
    recorder = Recorder()
    trainer = Trainer(
        tiny_llama(),
        args_for(
            tmp_path,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            num_train_epochs=2,
            logging_steps=3,
            eval_strategy="epoch",
            per_device_eval_batch_size=2,
        ),
        train_dataset=lm_rows(12),
        eval_dataset=lm_rows(4, seed=1),
        callbacks=[recorder],
    )
    recorder.events.clear()  # drop on_init_end (checked below)
    trainer.train()

    def step(n, log=False):
        ev = [
            ("on_step_begin", n - 1),
            ("on_substep_end", n - 1),
            ("on_pre_optimizer_step", n - 1),
            ("on_optimizer_step", n - 1),
            ("on_step_end", n),
        ]
        return ev + ([("on_log", n)] if log else [])

    def evaluation(n):
        return [("on_prediction_step", n), ("on_prediction_step", n), ("on_log", n), ("on_evaluate", n)]

    expected = [("on_train_begin", 0)]
    for epoch in range(2):
        expected += [("on_epoch_begin", 3 * epoch)]
        for s in range(1, 4):
            expected += step(3 * epoch + s, log=s == 3)
        expected += [("on_epoch_end", 3 * epoch + 3)] + evaluation(3 * epoch + 3)
    expected += [("on_log", 6), ("on_train_end", 6)]  # the run summary, then the end
    assert recorder.events == expected
    assert Recorder().events == [] and len(EVENTS) == 15


def test_on_init_end_fires_once():
    recorder = Recorder()
    Trainer(tiny_llama(), args_for("unused"), callbacks=[recorder])
    assert recorder.events == [("on_init_end", 0)]


def test_a_misspelt_event_is_rejected_with_the_valid_names(tmp_path):
    class Typo(TrainerCallback):
        def on_step_ended(self, args, state, control, **kwargs):
            pass

    with pytest.raises(ValueError, match=r"Typo.on_step_ended is not a callback event.*on_step_end"):
        Trainer(tiny_llama(), args_for(tmp_path), callbacks=[Typo()])
    trainer = Trainer(tiny_llama(), args_for(tmp_path))
    with pytest.raises(ValueError, match="on_step_ended"):
        trainer.add_callback(Typo)


def test_a_transformers_callback_works_unchanged(tmp_path):
    import transformers

    class HFStopper(transformers.TrainerCallback):
        """Written for transformers: stops after step 3 and counts logs."""

        def __init__(self):
            self.logs = 0

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= 3:
                control.should_training_stop = True
            return control

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs += 1

    cb = HFStopper()
    trainer = Trainer(
        tiny_llama(), args_for(tmp_path, max_steps=10, logging_steps=1), train_dataset=lm_rows(40), callbacks=[cb]
    )
    trainer.train()
    assert trainer.state.global_step == 3 and cb.logs == 4  # 3 step logs + the run summary


def test_add_pop_remove_callback(tmp_path):
    trainer = Trainer(tiny_llama(), args_for(tmp_path))
    names = lambda: [type(c).__name__ for c in trainer.callback_handler.callbacks]  # noqa: E731
    assert names() == [
        "FlowCallback",
        "MetricsFileCallback",
        "RunSummaryCallback",
        "RunInfoCallback",
        "PreemptionCallback",
        "PrinterCallback",
    ]
    popped = trainer.pop_callback(PrinterCallback)
    assert isinstance(popped, PrinterCallback) and "PrinterCallback" not in names()
    trainer.add_callback(popped)
    trainer.remove_callback(popped)
    assert "PrinterCallback" not in names()
    assert trainer.pop_callback(ProgressCallback) is None


def test_early_stopping_stops_when_the_metric_stops_improving(tmp_path):
    # learning_rate 0: eval_loss never improves after the first evaluation -> stop after patience more evals
    trainer = Trainer(
        tiny_llama(),
        args_for(
            tmp_path,
            max_steps=50,
            learning_rate=0.0,
            eval_strategy="steps",
            eval_steps=2,
            metric_for_best_model="loss",
            logging_steps=100,
        ),
        train_dataset=lm_rows(40),
        eval_dataset=lm_rows(4, seed=1),
        callbacks=[EarlyStoppingCallback(early_stopping_patience=2)],
    )
    trainer.train()
    assert trainer.state.global_step == 6  # evals at 2 (best), 4 (no gain), 6 (no gain) -> stop
    assert trainer.state.stateful_callbacks["EarlyStoppingCallback"]["bad_evals"] == 2


def test_early_stopping_keeps_going_while_improving(tmp_path):
    trainer = Trainer(
        tiny_llama(),
        args_for(
            tmp_path,
            max_steps=8,
            learning_rate=3e-3,
            eval_strategy="steps",
            eval_steps=2,
            metric_for_best_model="loss",
        ),
        train_dataset=lm_rows(8, min_len=10, max_len=10),
        eval_dataset=lm_rows(8, min_len=10, max_len=10),
        callbacks=[EarlyStoppingCallback(1)],
    )
    trainer.train()
    evals = [(e["step"], e["eval_loss"]) for e in trainer.state.log_history if "eval_loss" in e]
    assert [step for step, _ in evals] == [2, 4, 6, 8]  # the callback saw an evaluation every 2 steps
    losses = [loss for _, loss in evals]
    assert all(later < earlier for earlier, later in zip(losses, losses[1:]))  # each one improved: no stop
    assert trainer.state.global_step == 8


def test_early_stopping_needs_a_metric(tmp_path):
    trainer = Trainer(
        tiny_llama(), args_for(tmp_path, max_steps=2), train_dataset=lm_rows(8), callbacks=[EarlyStoppingCallback()]
    )
    with pytest.raises(ValueError, match="metric_for_best_model"):
        trainer.train()


def test_flow_callback_sets_the_cadence(tmp_path):
    args = args_for(
        tmp_path, logging_steps=2, eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=4
    )
    from treadle.callbacks import TrainerControl, TrainerState

    state = TrainerState(max_steps=12, logging_steps=2, eval_steps=3, save_steps=4)
    seen = []
    for step in range(1, 13):
        state.global_step = step
        control = FlowCallback().on_step_end(args, state, TrainerControl())
        seen.append((control.should_log, control.should_evaluate, control.should_save, control.should_training_stop))
    assert [s for s, flags in enumerate(seen, 1) if flags[0]] == [2, 4, 6, 8, 10, 12]
    assert [s for s, flags in enumerate(seen, 1) if flags[1]] == [3, 6, 9, 12]
    assert [s for s, flags in enumerate(seen, 1) if flags[2]] == [4, 8, 12]
    assert [s for s, flags in enumerate(seen, 1) if flags[3]] == [12]


def test_printer_prints_each_log(tmp_path, capsys):
    Trainer(tiny_llama(), args_for(tmp_path, max_steps=2, logging_steps=1), train_dataset=lm_rows(8)).train()
    out = capsys.readouterr().out
    assert out.count("[step 1] loss=") == 1 and out.count("[step 2] loss=") == 1 and "train_runtime=" in out


def test_progress_bar_counts_steps_and_writes_logs(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # bars are for a terminal
    trainer = Trainer(
        tiny_llama(), args_for(tmp_path, max_steps=3, logging_steps=3, disable_tqdm=False), train_dataset=lm_rows(8)
    )
    bar = next(c for c in trainer.callback_handler.callbacks if isinstance(c, ProgressCallback))
    seen = []
    trainer.add_callback(
        type("Peek", (TrainerCallback,), {"on_step_end": lambda self, a, s, c, **k: seen.append(bar.training_bar.n)})
    )
    trainer.train()
    captured = capsys.readouterr()
    assert seen == [1, 2, 3]
    assert "[step 3] loss=" in captured.out + captured.err and "3/3" in captured.err


def test_without_a_terminal_no_bars_only_log_lines(tmp_path, capsys):
    """Output redirected (stderr not a terminal, as under pytest): no tqdm bars, nested or not; each log a line."""
    trainer = Trainer(
        tiny_llama(), args_for(tmp_path, max_steps=2, logging_steps=1, disable_tqdm=False), train_dataset=lm_rows(8)
    )
    bar = next(c for c in trainer.callback_handler.callbacks if isinstance(c, ProgressCallback))
    trainer.train()
    captured = capsys.readouterr()
    assert bar.training_bar is None and "it/s" not in captured.err and "2/2" not in captured.err
    assert captured.out.count("[step 1] loss=") == 1 and captured.out.count("[step 2] loss=") == 1


def test_a_printed_line_shows_the_watched_metrics_and_counts_the_rest(capsys):
    """A GRPO step's 22 metrics print as a line of the few watched ones and a count of the rest (under 200
    characters, against 560-700 before); a log holding no watched key (a user's own, the run summary) prints
    whole; watched=None prints all."""
    grpo = {
        "loss": 0.01,
        "grad_norm": 0.5,
        "learning_rate": 1e-3,
        "clip_ratio/high_mean": 0.0,
        "clip_ratio/low_mean": 0.0,
        "clip_ratio/region_mean": 0.0,
        "completions/clipped_ratio": 0.25,
        "completions/max_length": 48,
        "completions/mean_length": 40.5,
        "completions/min_length": 12,
        "entropy": 2.5,
        "frac_reward_zero_std": 0.0,
        "health/all_truncated": 0.0,
        "health/no_signal": 0.0,
        "reward": 0.11,
        "reward_group_std": 0.05,
        "reward_std": 0.06,
        "rewards/environment_reward/mean": 0.11,
        "rewards/environment_reward/std": 0.06,
        "rollouts/truncated": 0.25,
        "rollouts/turns": 4.5,
        "kl": 0.002,
    }
    state = TrainerState(global_step=7)
    PrinterCallback(watched_keys(GRPOTrainer.watched_metrics)).on_log(None, state, None, logs=grpo)
    PrinterCallback().on_log(None, state, None, logs=grpo)  # the loop's own keys: it knows no trainer's
    PrinterCallback().on_log(None, state, None, logs={"my_metric": 3.0, "other": 1})
    PrinterCallback(watched=None).on_log(None, state, None, logs=grpo)
    short, loop, own, whole = capsys.readouterr().out.splitlines()
    assert short == (
        "[step 7] loss=0.01  reward=0.11  reward_std=0.06  kl=0.002  entropy=2.5  "
        "completions/mean_length=40.5  grad_norm=0.5  learning_rate=0.001  (+14 more in metrics.jsonl)"
    )
    assert loop == "[step 7] loss=0.01  grad_norm=0.5  learning_rate=0.001  (+19 more in metrics.jsonl)"
    assert len(short) < 200 and own == "[step 7] my_metric=3  other=1"
    assert whole.count("=") == 22 and len(whole) > 500


def test_the_end_summary_shows_an_evaluation_by_its_watched_numbers_and_never_an_empty_one(tmp_path):
    """A GRPO evaluation (eval_reward, eval_pass@1: neither a loss nor an accuracy) printed "last eval (step 8): "
    with nothing after it; now it shows the watched numbers, and an evaluation of none of them is left out."""
    args = args_for(tmp_path)
    grpo = TrainerState(
        global_step=8,
        max_steps=8,
        log_history=[{"step": 8, "eval_reward": 0.25, "eval_pass@1": 0.5, "eval_completions/mean_length": 9.0}],
    )
    watched = watched_keys(GRPOTrainer.watched_metrics)
    assert "last eval (step 8): eval_reward=0.25  eval_pass@1=0.5" in run_summary(args, grpo, watched)
    own = TrainerState(global_step=8, max_steps=8, log_history=[{"step": 8, "eval_my_score": 3.0}])
    assert "last eval" not in run_summary(args, own, watched)


def test_a_trainer_adds_its_own_lines_to_the_end_summary_through_a_hook(tmp_path, capsys):
    """The loop's summary knows no trainer: a subclass's ``summary_lines`` and ``watched_metrics`` reach it."""

    class Noted(Trainer):
        watched_metrics = ("my_metric",)

        def summary_lines(self):
            return [f"my line after step {self.state.global_step}"]

    trainer = Noted(tiny_llama(), args_for(tmp_path, max_steps=2, logging_steps=1), train_dataset=lm_rows(16))
    trainer.train()
    out = capsys.readouterr().out
    assert "treadle: finished at step 2 of 2" in out and "\n  my line after step 2" in out
    summary = next(c for c in trainer.callback_handler.callbacks if type(c).__name__ == "RunSummaryCallback")
    assert summary.watched == ("loss", "eval_loss", "my_metric", "grad_norm", "learning_rate", "eval_accuracy")


def test_metrics_file_is_cut_back_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "lo')
    state = TrainerState(global_step=2)
    MetricsFileCallback().on_train_begin(args_for(tmp_path), state, None)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_tensorboard_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    Trainer(
        tiny_llama(),
        args_for(tmp_path, max_steps=2, logging_steps=1, report_to="tensorboard"),
        train_dataset=lm_rows(8),
    ).train()
    found = [f for _, _, files in os.walk(tmp_path / "runs") for f in files if f.startswith("events.out.tfevents")]
    assert found
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(
        os.path.dirname(
            next(os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "runs") for f in fs if f.startswith("events"))
        )
    )
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2]


def test_a_callback_can_stop_training_through_control(tmp_path):
    class StopAt2(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= 2

    trainer = Trainer(tiny_llama(), args_for(tmp_path, max_steps=10), train_dataset=lm_rows(40), callbacks=[StopAt2()])
    trainer.train()
    assert trainer.state.global_step == 2
    assert torch.isfinite(torch.tensor(trainer.state.log_history[-1]["train_loss"]))


def test_a_signal_of_an_earlier_run_does_not_stop_the_next(tmp_path):
    import signal

    from treadle.callbacks import PreemptionCallback

    trainer = Trainer(tiny_llama(), args_for(tmp_path, max_steps=2), train_dataset=lm_rows(8))
    trainer.preemption.signal = signal.SIGTERM  # as left by a preempted run
    trainer.pop_callback(PreemptionCallback)  # the user handles signals herself now
    assert trainer.train().global_step == 2  # no SystemExit
    assert not any(name.startswith("checkpoint-") for name in os.listdir(tmp_path))
