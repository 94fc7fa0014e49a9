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
import os
import signal
import sys
import threading

from treadle import distributed as dist
from treadle.checkpoint import path_for
from treadle.describe import describe_run
from treadle.errors import Interrupted, Preempted, resume_hint, stopped_by
from treadle.record import runfiles
from treadle.state import LoopState, TrainerControl, TrainerState  # noqa: F401 (re-exported: transformers.trainer_callback's path)

EVENTS = (
    "on_init_end",
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_step_begin",
    "on_substep_end",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_step_end",
    "on_evaluate",
    "on_predict",
    "on_prediction_step",
    "on_save",
    "on_log",
)


class TrainerCallback:
    """Base class: override the events you need. A method named ``on_<something>`` that is not an event is
    rejected when the callback is added, so a typo never silently does nothing."""

    def on_init_end(self, args, state, control, **kwargs):
        pass

    def on_train_begin(self, args, state, control, **kwargs):
        pass

    def on_train_end(self, args, state, control, **kwargs):
        pass

    def on_epoch_begin(self, args, state, control, **kwargs):
        pass

    def on_epoch_end(self, args, state, control, **kwargs):
        pass

    def on_step_begin(self, args, state, control, **kwargs):
        pass

    def on_substep_end(self, args, state, control, **kwargs):
        pass

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        pass

    def on_optimizer_step(self, args, state, control, **kwargs):
        pass

    def on_step_end(self, args, state, control, **kwargs):
        pass

    def on_evaluate(self, args, state, control, **kwargs):
        pass

    def on_predict(self, args, state, control, **kwargs):
        pass

    def on_prediction_step(self, args, state, control, **kwargs):
        pass

    def on_save(self, args, state, control, **kwargs):
        pass

    def on_log(self, args, state, control, **kwargs):
        pass


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
                raise ValueError(
                    f"{cls.__name__}.{name} is not a callback event (misspelt?); valid events: {', '.join(EVENTS)}"
                )


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
            print(
                f"treadle: adding a second {type(cb).__name__}; the callbacks are now "
                f"{[type(c).__name__ for c in self.callbacks + [cb]]}",
                file=sys.stderr,
            )
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
                args,
                state,
                control,
                model=self.model,
                processing_class=self.processing_class,
                optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler,
                train_dataloader=self.train_dataloader,
                eval_dataloader=self.eval_dataloader,
                **kwargs,
            )
            if result is not None:  # transformers semantics: a callback may return a new control
                control = result
        return control


# ---------------------------------------------------------------------------------------------------------
# Built-in callbacks
# ---------------------------------------------------------------------------------------------------------
class FlowCallback(TrainerCallback):
    """The cadence of logging, evaluation and saving (so the loop holds no ``step % N``). As transformers 5's
    ``DefaultFlowCallback``, except that the last step also logs what the window holds (transformers leaves out
    a last window that does not end on a ``logging_steps`` multiple)."""

    def on_train_begin(self, args, state, control, **kwargs):
        if args.eval_on_start:
            control.should_evaluate = True
        return control

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if step == 1 and args.logging_first_step:
            control.should_log = True
        if args.logging_strategy == "steps" and step % state.logging_steps == 0:
            control.should_log = True
        if args.eval_strategy == "steps" and step >= args.eval_delay:
            # the last step evaluates too when it is not a multiple of eval_steps (transformers 5)
            if step % state.eval_steps == 0 or step >= state.max_steps:
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
        if args.eval_strategy == "epoch" and state.epoch >= args.eval_delay:
            control.should_evaluate = True
        if args.save_strategy == "epoch":
            control.should_save = True
        return control


class MetricsFileCallback(TrainerCallback):
    """Appends every log event to ``output_dir/metrics.jsonl`` (one JSON object a line, with step and epoch),
    and writes the run's arguments beside it (``training_args.json``) when training begins.

    On resume the file is cut back to the resumed step, so the file never holds a step twice."""

    def path(self, args) -> str:
        return os.path.join(args.output_dir, runfiles.METRICS_FILE)

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        runfiles.write_args(args.output_dir, args.to_json_string())  # the run's config beside its metrics
        # a resumed run logs the steps after its checkpoint again; an earlier run's end-of-run summary goes too
        runfiles.cut_back(self.path(args), lambda r: r["step"] <= state.global_step and "train_runtime" not in r)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        runfiles.append_entries(self.path(args), [{"step": state.global_step, "epoch": round(state.epoch, 6), **logs}])


class RunInfoCallback(TrainerCallback):
    """Writes what made the run, beside its arguments, when training begins: ``output_dir/run.json`` with the
    model, the datasets, the reward functions and the LoRA settings (``treadle.describe``). It reads its
    trainer's public attributes then (a GRPO trainer's reward functions exist only after the Trainer's constructor)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            runfiles.write_run_info(args.output_dir, describe_run(self.trainer))


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
            raise ValueError(
                "EarlyStoppingCallback needs args.metric_for_best_model (e.g. 'loss') and an "
                "eval_strategy other than 'no'"
            )
        if args.eval_strategy == "no":
            raise ValueError("EarlyStoppingCallback needs evaluations: set eval_strategy='steps' or 'epoch'")

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        key = args.metric_for_best_model
        key = key if key.startswith("eval_") else f"eval_{key}"
        if not metrics or key not in metrics:
            raise KeyError(
                f"EarlyStoppingCallback: {key!r} is not among the evaluation metrics "
                f"{sorted(metrics or {})}; set metric_for_best_model to one of them"
            )
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
    """SIGTERM / Ctrl-C: finish the current optimizer step, save a whole checkpoint, end training, then raise
    (``raise_if_stopped``: the Trainer calls it after ``on_train_end``).

    ``guard()`` (the Trainer runs its loop inside it; ``treadle train`` runs the whole run, final save included,
    inside another) installs the handlers in the main thread and restores the previous ones afterwards; the
    outermost one starts from no signal. A signal only records itself (``signal``); at the next step end this
    callback asks through ``control`` for a checkpoint (even with ``save_strategy="no"``: a preempted run keeps its
    work) and a stop (``stopped``). A signal after the last step's end stops nothing: the caller finds it in
    ``signal`` once the final save is done. Under several processes the ranks agree first, so one rank's signal
    stops all of them after the same step. A second Ctrl-C stops at once, except inside ``guard(hold=True)`` (a
    save that must complete)."""

    def __init__(self):
        self.signal: int | None = None  # the signal that arrived, None while none has
        self.stopped = False  # whether a signal stopped the loop (its checkpoint saved): train() raises
        self._depth = 0

    @contextlib.contextmanager
    def guard(self, hold: bool = False):
        if threading.current_thread() is not threading.main_thread():  # handlers can only be set there
            yield
            return

        def request_stop(signum, frame):
            if self.signal is not None and signum == signal.SIGINT and not hold:
                raise KeyboardInterrupt
            self.signal = signum

        if self._depth == 0:  # a signal that stopped an earlier run does not stop this one
            self.signal, self.stopped = None, False
        self._depth += 1
        previous = {s: signal.signal(s, request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            self._depth -= 1
            for s, handler in previous.items():
                signal.signal(s, handler)

    @contextlib.contextmanager
    def abandoned_step(self, state, control):
        """Around the loop's epochs: a wait inside a step that gave way to this callback's signal (a request to a vLLM
        server, ``engines.vllm_client``, raises ``Preempted`` / ``Interrupted`` rather than wait for its answer)
        leaves that step unfinished; the steps done are saved and the run stops as after a step end. Before the
        first step there is nothing to save: the stop propagates as it came."""
        try:
            yield
        except (Preempted, Interrupted):
            if state.global_step == 0 or self.signal is None:
                raise
            self.stopped = control.should_save = control.should_training_stop = True

    def on_step_end(self, args, state, control, **kwargs):
        self._stop_if_signalled(args, state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._stop_if_signalled(args, state, control)  # a signal during the epoch's last step's log or evaluation

    def _stop_if_signalled(self, args, state, control) -> None:
        stop = self.signal is not None
        if state.world_size > 1:  # a collective: every rank calls it at every step and epoch end
            stop = dist.any_rank(stop, args.device)
        if stop:
            self.signal = self.signal or signal.SIGTERM  # a peer's signal stops this rank too
            self.stopped = control.should_save = control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        if self.stopped and state.is_world_process_zero:
            print(
                f"treadle: stopped by {signal.Signals(self.signal).name} after step {state.global_step}; "
                f"checkpoint: {path_for(args.output_dir, state.global_step)}; {resume_hint()}.",
                file=sys.stderr,
                flush=True,
            )

    def raise_if_stopped(self, args, state) -> None:
        """After ``on_train_end`` of a run a signal stopped (its checkpoint written): raise
        ``errors.Interrupted`` (Ctrl-C, a KeyboardInterrupt) or ``errors.Preempted`` (SIGTERM, exit 143)."""
        if self.stopped:
            raise stopped_by(self.signal, state.global_step, path_for(args.output_dir, state.global_step))
