"""Callbacks: they decide *when and whether* things happen; subclassing the Trainer decides *what* happens.

The events, in the order the loop fires them (``Trainer.train``)::

    on_init_end                                   # end of Trainer.__init__
    on_train_begin
    for epoch:
        on_epoch_begin
        for each optimizer step (gradient_accumulation_steps micro-batches):
            on_step_begin
            for each micro-batch except the last:  training_step(); on_substep_end
            training_step() on the last micro-batch
            on_pre_optimizer_step                 # gradients are complete, before clipping
            on_optimizer_step                     # after optimizer.step(), before zero_grad
            on_step_end                           # FlowCallback sets control.should_log / _evaluate / _save
            on_log        (if control.should_log)
            evaluate(): on_prediction_step per batch, on_evaluate   (if control.should_evaluate)
            on_save       (if control.should_save)
        on_epoch_end                              # FlowCallback may set the flags again for epoch cadence
        (on_log / on_evaluate / on_save as above)
    on_train_end

``evaluate()`` and ``predict()`` outside training fire ``on_prediction_step`` per batch, then ``on_evaluate`` /
``on_predict``. Every method has the signature of ``transformers.TrainerCallback``:
``on_x(args, state, control, **kwargs)``, with ``model``, ``processing_class``, ``optimizer``,
``lr_scheduler``, ``train_dataloader`` and ``eval_dataloader`` in kwargs (plus ``logs`` / ``metrics``). A
callback talks back only by setting fields of the ``TrainerControl`` it receives (or returning one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

EVENTS = (
    "on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_step_begin",
    "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_evaluate",
    "on_predict", "on_prediction_step", "on_save", "on_log",
)


@dataclass
class TrainerState:
    """What the loop knows about the run; saved as ``trainer_state.json`` in every checkpoint."""

    epoch: float = 0.0  # fractional epoch reached (2.5 = halfway through the third epoch)
    global_step: int = 0  # optimizer steps done
    max_steps: int = 0  # optimizer steps this run will do
    num_train_epochs: int = 0  # epochs this run will start
    steps_per_epoch: int = 0  # optimizer steps in one pass over the training dataloader
    logging_steps: int = 10
    eval_steps: int = 10
    save_steps: int = 500
    train_batch_size: int = 0  # per-device micro-batch rows
    gradient_accumulation_steps: int = 1
    world_size: int = 1
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    total_loss_sum: float = 0.0  # item-weighted loss summed over the whole run (survives resumes)
    total_loss_items: float = 0.0
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)  # callback name -> its saved state

    # --- read by transformers' tracker callbacks (treadle.trackers); treadle runs no hyper-parameter search
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None

    @classmethod
    def for_run(cls, args, **plan) -> "TrainerState":
        """The state at the start of a run with ``args``: its cadence, batch shape and process layout, and the
        ``plan`` (``steps_per_epoch``, ``max_steps``, ``num_train_epochs``)."""
        from treadle import distributed as dist

        return cls(logging_steps=args.logging_steps, eval_steps=args.eval_steps, save_steps=args.save_steps,
                   train_batch_size=args.per_device_train_batch_size,
                   gradient_accumulation_steps=args.gradient_accumulation_steps, world_size=dist.get_world_size(),
                   is_world_process_zero=dist.is_main_process(), is_local_process_zero=args.local_process_index == 0,
                   **plan)

    def save_to_json(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load_from_json(cls, path: str) -> "TrainerState":
        with open(path) as f:
            data = json.load(f)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class LoopState:
    """The loop's bookkeeping that is not ``TrainerState`` (not saved: a step never spans a checkpoint).
    Created in ``__init__``; outside ``train()`` it describes one lone micro-batch, so that ``training_step``
    can be called on its own."""

    window_size: int = 1  # micro-batches in the accumulation window of the step in progress
    micro_batch: Any = None  # the raw micro-batch in training_step: compute_loss counts its items there if needed
    grad_norm: Any = None  # of the last optimizer step, before clipping
    last_saved_step: int | None = None
    last_eval: tuple[int | None, dict | None] = (None, None)  # (step, metrics) of the latest evaluation


@dataclass
class TrainerControl:
    """The one channel through which callbacks steer the loop."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def _new_training(self) -> None:
        self.should_training_stop = False

    def _new_epoch(self) -> None:
        self.should_epoch_stop = False

    def _new_step(self) -> None:
        self.should_save = False
        self.should_evaluate = False
        self.should_log = False


class TrainerCallback:
    """Base class: override the events you need. A method named ``on_<something>`` that is not an event is
    rejected when the callback is added, so a typo never silently does nothing."""

    def on_init_end(self, args, state, control, **kwargs): pass
    def on_train_begin(self, args, state, control, **kwargs): pass
    def on_train_end(self, args, state, control, **kwargs): pass
    def on_epoch_begin(self, args, state, control, **kwargs): pass
    def on_epoch_end(self, args, state, control, **kwargs): pass
    def on_step_begin(self, args, state, control, **kwargs): pass
    def on_substep_end(self, args, state, control, **kwargs): pass
    def on_pre_optimizer_step(self, args, state, control, **kwargs): pass
    def on_optimizer_step(self, args, state, control, **kwargs): pass
    def on_step_end(self, args, state, control, **kwargs): pass
    def on_evaluate(self, args, state, control, **kwargs): pass
    def on_predict(self, args, state, control, **kwargs): pass
    def on_prediction_step(self, args, state, control, **kwargs): pass
    def on_save(self, args, state, control, **kwargs): pass
    def on_log(self, args, state, control, **kwargs): pass


def check_callback(callback) -> None:
    """Reject a callback that defines an ``on_*`` method which is not an event (a misspelling).

    Methods inherited from ``transformers.TrainerCallback`` are not checked: that base class may know events
    (e.g. ``on_push_begin``) that treadle never fires, and a callback written for it must work unchanged.
    """
    cls = callback if isinstance(callback, type) else type(callback)
    for klass in cls.__mro__:
        if klass is TrainerCallback or klass is object or klass.__module__.startswith("transformers."):
            continue
        for name in vars(klass):
            if name.startswith("on_") and name not in EVENTS:
                raise ValueError(f"{cls.__name__}.{name} is not a callback event (misspelt?); "
                                 f"valid events: {', '.join(EVENTS)}")


class CallbackHandler:
    """Calls the callbacks in order; holds the objects every event receives in kwargs."""

    def __init__(self, callbacks, model, processing_class, optimizer=None, lr_scheduler=None):
        self.callbacks: list = []
        for cb in callbacks:
            self.add_callback(cb)
        self.model = model
        self.processing_class = processing_class
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.train_dataloader = None
        self.eval_dataloader = None

    def add_callback(self, callback) -> None:
        check_callback(callback)
        cb = callback() if isinstance(callback, type) else callback
        if any(type(c) is type(cb) for c in self.callbacks):
            print(f"treadle: adding a second {type(cb).__name__}; the callbacks are now "
                  f"{[type(c).__name__ for c in self.callbacks + [cb]]}", file=sys.stderr)
        self.callbacks.append(cb)

    def pop_callback(self, callback):
        for cb in self.callbacks:
            if (isinstance(callback, type) and type(cb) is callback) or cb is callback:
                self.callbacks.remove(cb)
                return cb
        return None

    def remove_callback(self, callback) -> None:
        self.pop_callback(callback)

    def call_event(self, event: str, args, state, control, **kwargs):
        for callback in self.callbacks:
            result = getattr(callback, event)(
                args, state, control, model=self.model, processing_class=self.processing_class,
                optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                train_dataloader=self.train_dataloader, eval_dataloader=self.eval_dataloader, **kwargs)
            if result is not None:  # transformers semantics: a callback may return a new control
                control = result
        return control


# ---------------------------------------------------------------------------------------------------------
# Built-in callbacks
# ---------------------------------------------------------------------------------------------------------
class FlowCallback(TrainerCallback):
    """The cadence of logging, evaluation and saving (so the loop holds no ``step % N``)."""

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if step == 1 and args.logging_first_step:
            control.should_log = True
        if args.logging_strategy == "steps" and step % state.logging_steps == 0:
            control.should_log = True
        if args.eval_strategy == "steps" and step % state.eval_steps == 0:
            control.should_evaluate = True
        if args.save_strategy == "steps" and step % state.save_steps == 0:
            control.should_save = True
        if step >= state.max_steps:
            control.should_training_stop = True
            control.should_log = control.should_log or args.logging_strategy != "no"
            control.should_save = control.should_save or args.save_strategy != "no"
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if args.logging_strategy == "epoch":
            control.should_log = True
        if args.eval_strategy == "epoch":
            control.should_evaluate = True
        if args.save_strategy == "epoch":
            control.should_save = True
        return control


def format_logs(logs: dict[str, Any]) -> str:
    """``{'loss': 1.23456789}`` -> ``loss=1.235`` — short, aligned, readable."""
    parts = []
    for key, value in logs.items():
        if isinstance(value, float):
            value = f"{value:.4g}" if math.isfinite(value) and abs(value) >= 1e-3 or value == 0 else f"{value:.3e}"
        parts.append(f"{key}={value}")
    return "  ".join(parts)


class PrinterCallback(TrainerCallback):
    """Prints each log as one line (used when progress bars are disabled)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            print(f"[step {state.global_step}] {format_logs(logs)}", flush=True)


class ProgressCallback(TrainerCallback):
    """tqdm bars for training and evaluation; logs are written above the bar."""

    def __init__(self):
        self.training_bar = None
        self.prediction_bar = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            from tqdm.auto import tqdm

            self.training_bar = tqdm(total=state.max_steps, initial=state.global_step, desc="train",
                                     dynamic_ncols=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            self.training_bar.update(state.global_step - self.training_bar.n)

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if not state.is_world_process_zero or eval_dataloader is None:
            return
        if self.prediction_bar is None:
            from tqdm.auto import tqdm

            total = len(eval_dataloader) if hasattr(eval_dataloader, "__len__") else None
            self.prediction_bar = tqdm(total=total, desc="eval", leave=self.training_bar is None,
                                       dynamic_ncols=True)
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
            line = f"[step {state.global_step}] {format_logs(logs)}"
            if self.training_bar is not None:
                self.training_bar.write(line)
            else:
                print(line, flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            self.training_bar.close()
            self.training_bar = None


class MetricsFileCallback(TrainerCallback):
    """Appends every log event to ``output_dir/metrics.jsonl`` (one JSON object a line, with step and epoch),
    and writes the run's arguments beside it (``training_args.json``) when training begins.

    On resume the file is cut back to the resumed step, so the file never holds a step twice."""

    def path(self, args) -> str:
        return os.path.join(args.output_dir, "metrics.jsonl")

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:  # the run's config beside its metrics (report.html shows it)
            from treadle.checkpoint import ARGS_FILE

            os.makedirs(args.output_dir, exist_ok=True)
            with open(os.path.join(args.output_dir, ARGS_FILE), "w") as f:
                f.write(args.to_json_string() + "\n")
        if not state.is_world_process_zero or not os.path.exists(self.path(args)):
            return
        kept = []
        with open(self.path(args)) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a crash mid-write
                    continue
                if record.get("step", 0) <= state.global_step and "train_runtime" not in record:
                    kept.append(line if line.endswith("\n") else line + "\n")
        with open(self.path(args), "w") as f:
            f.writelines(kept)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        os.makedirs(args.output_dir, exist_ok=True)
        record = {"step": state.global_step, "epoch": round(state.epoch, 6), **logs}
        with open(self.path(args), "a") as f:
            f.write(json.dumps(record, default=float) + "\n")


class EarlyStoppingCallback(TrainerCallback):
    """Stop when ``metric_for_best_model`` has not improved by more than ``threshold`` for ``patience``
    evaluations in a row. The counter survives a resume (kept in ``state.stateful_callbacks``)."""

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float = 0.0):
        if early_stopping_patience < 1:
            raise ValueError(f"early_stopping_patience must be >= 1, got {early_stopping_patience}")
        self.patience = early_stopping_patience
        self.threshold = early_stopping_threshold

    def on_train_begin(self, args, state, control, **kwargs):
        if args.metric_for_best_model is None:
            raise ValueError("EarlyStoppingCallback needs args.metric_for_best_model (e.g. 'loss') and an "
                             "eval_strategy other than 'no'")
        if args.eval_strategy == "no":
            raise ValueError("EarlyStoppingCallback needs evaluations: set eval_strategy='steps' or 'epoch'")

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        key = args.metric_for_best_model
        key = key if key.startswith("eval_") else f"eval_{key}"
        if not metrics or key not in metrics:
            raise KeyError(f"EarlyStoppingCallback: {key!r} is not among the evaluation metrics "
                           f"{sorted(metrics or {})}; set metric_for_best_model to one of them")
        saved = state.stateful_callbacks.setdefault("EarlyStoppingCallback", {"best": None, "bad_evals": 0})
        value, best = metrics[key], saved["best"]
        sign = 1.0 if args.greater_is_better else -1.0
        if best is None or sign * (value - best) > self.threshold:
            saved["best"], saved["bad_evals"] = value, 0
        else:
            saved["bad_evals"] += 1
        if saved["bad_evals"] >= self.patience:
            control.should_training_stop = True


class PreemptionCallback(TrainerCallback):
    """SIGTERM / Ctrl-C: finish the current optimizer step, save a whole checkpoint, end training cleanly.

    ``guard()`` (the Trainer runs ``train`` inside it) installs the handlers in the main thread and restores
    the previous ones afterwards. A signal only records itself (``signal``); at the next step end this callback
    asks through ``control`` for a checkpoint (even with ``save_strategy="no"``: a preempted run keeps its work)
    and a stop. Under several processes the ranks agree first, so one rank's signal stops all of them after the
    same step. A second Ctrl-C stops at once."""

    def __init__(self):
        self.signal: int | None = None  # the signal that stopped the run, None while none has arrived

    @contextlib.contextmanager
    def guard(self):
        if threading.current_thread() is not threading.main_thread():  # handlers can only be set there
            yield
            return

        def request_stop(signum, frame):
            if self.signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.signal = signum

        previous = {s: signal.signal(s, request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def on_step_end(self, args, state, control, **kwargs):
        self._stop_if_signalled(args, state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._stop_if_signalled(args, state, control)  # a signal during the epoch's last step's log or evaluation

    def _stop_if_signalled(self, args, state, control) -> None:
        stop = self.signal is not None
        if state.world_size > 1:  # a collective: every rank calls it at every step and epoch end
            from treadle import distributed as dist

            stop = dist.any_rank(stop, args.device)
        if stop:
            self.signal = self.signal or signal.SIGTERM  # a peer's signal stops this rank too
            control.should_save = control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        if self.signal is not None and state.is_world_process_zero:
            from treadle.checkpoint import latest_checkpoint

            print(f"treadle: stopped by {signal.Signals(self.signal).name} after step {state.global_step}; "
                  f"checkpoint: {latest_checkpoint(args.output_dir)}. Resume with "
                  f"trainer.train(resume_from_checkpoint=True) (or `treadle train CONFIG --resume`).",
                  file=sys.stderr, flush=True)


DEFAULT_CALLBACKS = (FlowCallback, MetricsFileCallback)
