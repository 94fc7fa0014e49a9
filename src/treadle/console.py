"""What a run prints: one short line per log (the watched keys, the rest counted), progress bars on a terminal, a
header when training starts and a summary when it ends. The loop's own keys and lines; a trainer adds its own
through ``Trainer.watched_metrics`` and ``Trainer.summary_lines``, which the Trainer hands to these callbacks, so this
module knows no trainer."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

from treadle.callbacks import TrainerCallback
from treadle.data import device_batch_rows, step_rows

__all__ = [
    "WATCHED",
    "PrinterCallback",
    "ProgressCallback",
    "RunSummaryCallback",
    "format_logs",
    "log_line",
    "run_header",
    "run_summary",
    "show_progress_bars",
    "watched_keys",
]


def format_logs(logs: dict[str, Any]) -> str:
    """``{'loss': 1.23456789}`` -> ``loss=1.235`` — short, aligned, readable."""
    parts = []
    for key, value in logs.items():
        if isinstance(value, float):
            value = f"{value:.4g}" if math.isfinite(value) and abs(value) >= 1e-3 or value == 0 else f"{value:.3e}"
        parts.append(f"{key}={value}")
    return "  ".join(parts)


# The few numbers people watch, in print order; a printed line shows these and counts the rest, which are all in
# metrics.jsonl and the trackers (a GRPO step logs 19-25 metrics: 600 characters a line). The loop's own are the
# losses first and the optimizer's numbers last; a trainer puts its own between them (``Trainer.watched_metrics``).
LEAD, TAIL = ("loss", "eval_loss"), ("grad_norm", "learning_rate", "eval_accuracy")


def watched_keys(own: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The keys a printed log line shows, in order: the losses, a trainer's ``own`` keys, then the gradient norm, the
    learning rate and an evaluation's accuracy (``compute_metrics``' usual key).

    >>> watched_keys(("reward",))
    ('loss', 'eval_loss', 'reward', 'grad_norm', 'learning_rate', 'eval_accuracy')
    """
    return tuple(dict.fromkeys((*LEAD, *own, *TAIL)))


WATCHED = watched_keys()


def log_line(step: int, logs: dict[str, Any], watched: tuple[str, ...] | None = WATCHED) -> str:
    """``[step N] loss=...  reward=...  (+17 more in metrics.jsonl)``: the ``watched`` keys ``logs`` holds, or
    every key when it holds none of them (a user's own log, the end-of-training summary) or ``watched`` is None."""
    shown = {key: logs[key] for key in watched if key in logs} if watched is not None else {}
    if not shown:
        return f"[step {step}] {format_logs(logs)}"
    rest = len(logs) - len(shown)
    return f"[step {step}] {format_logs(shown)}" + (f"  (+{rest} more in metrics.jsonl)" if rest else "")


def show_progress_bars(args) -> bool:
    """Bars only on a terminal: redirected to a file, every redraw of a bar (and of the bars nested in it) is a
    line of noise, so a run whose output goes to a file prints log lines instead."""
    return not args.disable_tqdm and sys.stderr.isatty()


class PrinterCallback(TrainerCallback):
    """Prints each log as one short line of the ``watched`` keys (used when progress bars are off);
    ``PrinterCallback(watched=None)`` prints every key."""

    def __init__(self, watched: tuple[str, ...] | None = WATCHED):
        self.watched = watched

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            print(log_line(state.global_step, logs, self.watched), flush=True)


class ProgressCallback(TrainerCallback):
    """tqdm bars for training and evaluation on a terminal, each log a short line written above the bar; without a
    terminal (output redirected) no bars, only the lines."""

    def __init__(self, watched: tuple[str, ...] | None = WATCHED):
        self.watched = watched
        self.training_bar = None
        self.prediction_bar = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and show_progress_bars(args):
            from tqdm.auto import tqdm

            self.training_bar = tqdm(
                total=state.max_steps, initial=state.global_step, desc="train", dynamic_ncols=True
            )

    def on_step_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            self.training_bar.update(state.global_step - self.training_bar.n)

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if not state.is_world_process_zero or eval_dataloader is None or not show_progress_bars(args):
            return
        if self.prediction_bar is None:
            from tqdm.auto import tqdm

            total = len(eval_dataloader) if hasattr(eval_dataloader, "__len__") else None
            self.prediction_bar = tqdm(total=total, desc="eval", leave=self.training_bar is None, dynamic_ncols=True)
        self.prediction_bar.update(1)

    def _close_prediction_bar(self):
        if self.prediction_bar is not None:
            self.prediction_bar.close()
            self.prediction_bar = None

    def on_evaluate(self, args, state, control, **kwargs):
        self._close_prediction_bar()

    def on_predict(self, args, state, control, **kwargs):
        self._close_prediction_bar()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            line = log_line(state.global_step, logs, self.watched)
            if self.training_bar is not None:
                self.training_bar.write(line)
            else:
                print(line, flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            self.training_bar.close()
            self.training_bar = None


class RunSummaryCallback(TrainerCallback):
    """A header when training starts (model, parameters trainable / total, rows, steps and where that number
    comes from, the effective batch, the output folder) and a summary when it ends (train loss, the last and
    the best evaluation, the best checkpoint, then the lines ``summary_lines()`` returns: a trainer's own,
    ``Trainer.summary_lines``). Printed by the main process, on stdout."""

    def __init__(self, watched: tuple[str, ...] = WATCHED, summary_lines: Callable[[], list[str]] | None = None):
        self.watched, self.summary_lines = watched, summary_lines

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        if state.is_world_process_zero:
            print(run_header(args, state, model, train_dataloader), flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            lines = self.summary_lines() if self.summary_lines is not None else []
            print(run_summary(args, state, self.watched, lines), flush=True)


def run_header(args, state, model, dataloader) -> str:
    params = list(model.parameters()) if model is not None else []
    total, trainable = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    name = type(model).__name__ + (f" ({model.name_or_path})" if getattr(model, "name_or_path", "") else "")
    rows = len(dataloader.dataset) if hasattr(getattr(dataloader, "dataset", None), "__len__") else "?"
    device_rows = device_batch_rows(args, dataloader)
    per_step = step_rows(args, dataloader)
    capped = (
        f", per_device_train_batch_size={args.per_device_train_batch_size} capped at the rows there are"
        if device_rows < args.per_device_train_batch_size
        else ""
    )
    plan = (
        f"max_steps={args.max_steps}"
        if args.max_steps > 0
        else f"num_train_epochs={args.num_train_epochs:g} x {state.steps_per_epoch} steps per epoch, as max_steps="
        f"{args.max_steps} asks"
    )
    start = f", resuming at step {state.global_step}" if state.global_step else ""
    return "\n".join(
        [
            f"treadle: {state.trainer_class or 'Trainer'} run",
            f"  model   {name}: {total:,} parameters, {trainable:,} trainable",
            f"  data    {rows if isinstance(rows, str) else f'{rows:,}'} rows; {per_step} rows per step "
            f"({device_rows} per device x {args.gradient_accumulation_steps} accumulated x {state.world_size} "
            f"processes{capped})",
            f"  steps   {state.max_steps} ({plan}){start}",
            f"  output  {args.output_dir}",
        ]
    )


def run_summary(args, state, watched: tuple[str, ...] = WATCHED, lines: list[str] = ()) -> str:
    """The end-of-training summary: one line of the run's end, train loss, last evaluation (its ``watched`` keys,
    else its losses and accuracies) and best checkpoint, then ``lines``, each on a line of its own."""
    history = state.log_history
    done = "finished" if state.global_step >= state.max_steps else "stopped"
    parts = [f"treadle: {done} at step {state.global_step} of {state.max_steps}"]
    final = next((h for h in reversed(history) if "train_loss" in h), None)
    if final is not None:
        parts.append(format_logs({"train_loss": final["train_loss"]}))
    last_eval = next((h for h in reversed(history) if any(k.startswith("eval_") for k in h)), None)
    if last_eval is not None:  # the watched evaluation numbers, else its losses and accuracies
        shown = {k: last_eval[k] for k in watched if k.startswith("eval_") and k in last_eval} or {
            k: v for k, v in last_eval.items() if k.startswith("eval_") and k.endswith(("loss", "accuracy"))
        }
        parts += [f"last eval (step {last_eval['step']}): {format_logs(shown)}"] if shown else []
    if state.best_model_checkpoint:
        parts.append(
            f"best {args.metric_for_best_model} {state.best_metric:.4g} at step {state.best_global_step}: "
            f"{state.best_model_checkpoint}"
        )
    return "\n  ".join(["; ".join(parts), *lines])
