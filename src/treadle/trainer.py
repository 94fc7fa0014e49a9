"""The Trainer: a short, fixed training loop whose every step is a method you can override.

Override a method to change *what* happens, register a callback (treadle.callbacks) to change *when and
whether* it happens. The overridable methods, in the order a run calls them:

=======================  ==========================================================================
``prepare_training``     once per ``train()``, before the dataloader (DPO precomputes reference log-probs)
``get_train_dataloader`` once per ``train()``: what a micro-batch is (GRPO loads several steps' prompts)
``create_optimizer``     once, unless ``optimizers=(opt, sched)`` was given
``create_scheduler``     once, after the optimizer
``prepare_window``       once per optimizer step, with the raw micro-batches of the accumulation window
                         (GRPO generates and scores here); returns the micro-batches to train on
``get_num_items_in_batch`` once per optimizer step: the loss items of the whole window, over all ranks
``training_step``        per micro-batch: ``prepare_inputs`` -> ``compute_loss`` -> backward
``prepare_inputs``       per micro-batch: move to the device
``compute_loss``         per micro-batch: the loss, summed over items / ``num_items_in_batch``
``log``                  when a callback sets ``control.should_log``
``evaluate``             when ``control.should_evaluate``: ``get_eval_dataloader`` + ``prediction_step``
``save_model``           by you (final weights); checkpoints are written when ``control.should_save``
=======================  ==========================================================================

The loop is ``train`` -> ``_train_epoch`` -> ``_optimizer_step`` (events: treadle.callbacks); evaluation and prediction
are treadle.evaluation's, which ``Trainer`` inherits. Names and signatures follow ``transformers.Trainer``. Windowed
metrics (the loss, what a subclass records with ``self.metrics.add``) live in one ``MetricWindow``.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator

import torch

from treadle import checkpoint as ckpt, compilation, data, distributed as dist, models, peft as treadle_peft, resume
from treadle.allocator import freed_memory_kept
from treadle.arguments import TrainingArguments, check_config
from treadle.callbacks import CallbackHandler, FlowCallback, MetricsFileCallback, PreemptionCallback, RunInfoCallback
from treadle.console import PrinterCallback, ProgressCallback, RunSummaryCallback, watched_keys
from treadle.evaluation import Evaluation
from treadle.metrics import (
    MetricWindow,
    TrainOutput,
    check_logged_loss,
    count_input_tokens,
    fold_loss,
    input_tokens,
    record_loss,
    record_num_tokens,
    skip_nonfinite_step,
    speed_metrics,
    training_logs,
)
from treadle.optim import build_optimizer, build_scheduler
from treadle.record import runs
from treadle.state import LoopState, TrainerControl, TrainerState
from treadle.streaming import restore_stream, stream_state
from treadle.trackers import tracker_callbacks


class Trainer(Evaluation):
    """Trains ``model`` on ``train_dataset`` with ``args``; see the module docstring for what to override.

    ``model`` is a transformers ``PreTrainedModel`` or any ``nn.Module`` whose output has a ``loss`` (a dict
    key, attribute, or first tuple element) — or whose loss a subclass computes in ``compute_loss``.
    """

    config_class = TrainingArguments  # the arguments this trainer needs (subclasses name their config)
    watched_metrics: tuple[str, ...] = ()  # a subclass's metrics in the printed log line (console.watched_keys)
    # log TRL's num_tokens: every micro-batch's attention-mask tokens, all ranks (on-policy: per generation instead)
    logs_num_tokens = False

    def __init__(
        self,
        model=None,
        args: TrainingArguments | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
    ):
        if model is None:
            raise ValueError(f"{type(self).__name__} needs a model")
        self.args = self.check_args(args)
        # under torchrun: the process group exists before any data work
        dist.init_distributed(self.args.device, self.args.ddp_timeout)
        self.model = treadle_peft.apply_peft(model, peft_config, args=self.args).to(self.args.device)
        self.model_wrapped = self.model  # the DDP / FSDP wrapper once train() has wrapped it
        self.processing_class = processing_class
        models.check_vocabulary(self.model, processing_class)  # the CLI's preflight (load_model), for Python too
        self.data_collator = data_collator if data_collator is not None else data.collator_for(processing_class)
        self.train_dataset, self.eval_dataset, self.compute_metrics = train_dataset, eval_dataset, compute_metrics
        self.optimizer, self.lr_scheduler = optimizers
        self.state, self.control, self.loop = TrainerState(), TrainerControl(), LoopState()
        self.metrics = MetricWindow(self.args.device)
        self.preemption = PreemptionCallback()
        self.callback_handler = CallbackHandler(
            self._default_callbacks() + list(callbacks or []),
            self.model,
            processing_class,
            self.optimizer,
            self.lr_scheduler,
        )
        self._forward_params = models.forward_parameters(self.model)
        self._dropped_columns_logged: set[str] = set()
        self.control = self.callback_handler.call_event("on_init_end", self.args, self.state, self.control)

    @classmethod
    def check_args(cls, args):
        """``args``, or ``config_class()`` when None; a config of another class is refused."""
        return check_config(args, cls.config_class, cls.__name__)

    def _default_callbacks(self) -> list:
        watched = watched_keys(self.watched_metrics)
        reporting = [PrinterCallback(watched) if self.args.disable_tqdm else ProgressCallback(watched)]
        reporting += tracker_callbacks(self.args.report_to)  # W&B, MLflow, ...
        summary = RunSummaryCallback(watched, self.summary_lines)
        return [FlowCallback(), MetricsFileCallback(), summary, RunInfoCallback(self), self.preemption, *reporting]

    def summary_lines(self) -> list[str]:
        """This trainer's own lines in the summary printed when training ends (GRPO: reward, health); none here."""
        return []

    # ---- callbacks ----------------------------------------------------------------------------------------
    def add_callback(self, callback) -> None:
        """Add a callback (an instance, or a class to instantiate)."""
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        """Remove and return a callback (an instance, or the first of a class); None when absent."""
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback) -> None:
        self.callback_handler.remove_callback(callback)

    def _event(self, name: str, **kwargs) -> None:
        self.control = self.callback_handler.call_event(name, self.args, self.state, self.control, **kwargs)

    # ---- data ---------------------------------------------------------------------------------------------
    def prepare_training(self) -> None:
        """Once per ``train()``, before the dataloader: work on the data (DPO precomputes reference log-probs)."""

    def get_train_dataloader(self):
        """The training DataLoader: ``per_device_train_batch_size`` rows, shuffled by a seeded sampler that can
        resume mid-epoch. Override to change what one micro-batch is."""
        if self.train_dataset is None:
            raise ValueError("Trainer.train() needs a train_dataset")
        dataset = self.remove_unused_columns(self.train_dataset, "training")
        return self.build_dataloader(
            dataset,
            batch_size=self.args.per_device_train_batch_size,
            sampler=self.build_sampler(dataset, shuffle=True),
            drop_last=self.args.dataloader_drop_last,
        )

    def build_sampler(self, dataset, *, shuffle: bool):
        """A SeededSampler over ``dataset`` for this rank (None for an iterable dataset)."""
        return data.seeded_sampler(dataset, seed=self.args.data_seed, shuffle=shuffle)

    def build_dataloader(self, dataset, *, batch_size: int, sampler=None, collate_fn=None, drop_last=False):
        """A DataLoader with the Trainer's collator and worker settings (``data.build_dataloader``)."""
        return data.build_dataloader(
            dataset,
            self.args,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=collate_fn or self.data_collator,
            drop_last=drop_last,
        )

    def signature_columns(self) -> set[str] | None:
        """Dataset columns kept by ``remove_unused_columns``: the model forward's arguments and the label names.
        None keeps every column (a forward taking ``**kwargs``). Subclasses that tokenise columns themselves
        add their own names here."""
        if self._forward_params is None:
            return None
        return set(self._forward_params) | set(self.args.label_names)

    def remove_unused_columns(self, dataset, description: str = "training"):
        """Drop (when ``args.remove_unused_columns``) the columns that the model's forward does not take,
        naming them in the log the first time."""
        if not self.args.remove_unused_columns:
            return dataset
        return data.drop_unused_columns(
            dataset,
            self.signature_columns(),
            description=description,
            model_name=type(dist.unwrap_model(self.model)).__name__,
            announced=self._dropped_columns_logged,
        )

    # ---- optimisation -------------------------------------------------------------------------------------
    def create_optimizer(self):
        """AdamW (or SGD) over the trainable parameters, decay on matrices only. Called once, after wrapping."""
        if self.optimizer is None:
            self.optimizer = build_optimizer(self.model, self.args)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The learning-rate schedule over ``num_training_steps`` optimizer steps."""
        if self.lr_scheduler is None:
            self.lr_scheduler = build_scheduler(
                self.args.lr_scheduler_type,
                optimizer or self.optimizer,
                num_warmup_steps=self.args.num_warmup_steps(num_training_steps),
                num_training_steps=num_training_steps,
                scheduler_kwargs=self.args.lr_scheduler_kwargs,
            )
        return self.lr_scheduler

    # ---- the loss -----------------------------------------------------------------------------------------
    def count_items(self, inputs: dict) -> int | None:
        """Loss items in one micro-batch: label tokens that are not -100 (shifted by one for causal LMs,
        whose first token is never predicted). None when the batch has no labels."""
        labels = inputs.get(self.args.label_names[0]) if isinstance(inputs, dict) else None
        if not isinstance(labels, torch.Tensor):
            return None
        if labels.dim() >= 2 and models.is_causal_lm(dist.unwrap_model(self.model)):
            labels = labels[..., 1:]
        return int(labels.ne(-100).sum())

    def get_num_items_in_batch(self, batch_samples: list) -> int | None:
        """Items (e.g. label tokens) in one accumulation window (after ``prepare_window``), summed over all ranks:
        each micro-batch's loss is divided by it, so accumulation and data parallelism give the big batch's."""
        counts = [self.count_items(b) for b in batch_samples]
        if any(c is None for c in counts):
            return None
        if self.items_are_global():
            return int(dist.all_reduce_sum(torch.tensor(sum(counts), device=self.args.device)).item())
        return sum(counts)

    def items_are_global(self) -> bool:
        """Whether ``num_items_in_batch`` counts every rank's items (``average_tokens_across_devices`` under DDP)."""
        return dist.get_world_size() > 1 and self.args.average_tokens_across_devices

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The loss of one micro-batch: summed over its items and divided by ``num_items_in_batch`` (items of
        the whole window, all ranks). With ``num_items_in_batch=None``, the model's own mean loss.

        A forward that names a ``num_items_in_batch`` argument receives it and must return that sum / count. Any
        other model returns its mean over the micro-batch's items (``count_items``; shifted for causal LMs, see
        ``models.is_causal_lm``), which is rescaled here to its share of the window."""
        takes_items = "num_items_in_batch" in (self._forward_params or ())
        outputs = model(
            **inputs,
            **models.training_forward_kwargs(
                self._forward_params, inputs, num_items_in_batch if takes_items else None
            ),
        )
        loss = models.loss_of(outputs, inputs)
        if num_items_in_batch is not None and not takes_items:
            # counted on the raw batch the loop holds (on the CPU: no device sync); a lone call counts its inputs
            items = self.count_items(self.loop.micro_batch) if self.loop.micro_batch is not None else None
            if items is None:  # a lone call, or a raw batch that is not countable (a subclass builds the inputs)
                items = self.count_items(inputs)
            # no item in this micro-batch: the model's mean is 0/0; it contributes nothing to the window
            loss = loss * (items / num_items_in_batch) if items else loss.new_zeros(())
        return (loss, outputs) if return_outputs else loss

    def prepare_inputs(self, inputs):
        """Move one micro-batch to the device (its tensors; other values stay as they are)."""
        if not isinstance(inputs, dict):
            return inputs
        return {
            k: v.to(self.args.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in inputs.items()
        }

    def autocast(self):
        """bfloat16 autocast around forwards when ``args.bf16`` (CPU and GPU); a no-op otherwise."""
        bf16 = torch.autocast(device_type=self.args.device.type, dtype=torch.bfloat16) if self.args.bf16 else None
        return bf16 or contextlib.nullcontext()

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """One micro-batch: prepare, forward, backward. Returns the detached loss (its share of the window; with
        ``num_items_in_batch=None``, the model's mean over ``loop.window_size`` micro-batches)."""
        inputs = self.prepare_inputs(inputs)
        with self.autocast():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if num_items_in_batch is None:
            loss = loss / self.loop.window_size  # the model's mean per micro-batch: average them over the window
        if loss.requires_grad:  # DDP averages gradients over ranks, but num_items_in_batch counts all ranks' items
            global_items = num_items_in_batch is not None and self.items_are_global()
            (loss * dist.get_world_size() if global_items else loss).backward()
        return loss.detach()

    # ---- the loop -----------------------------------------------------------------------------------------
    @dist.rank_errors  # under torchrun an exception names the rank that raised it
    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Train for ``max_steps`` (or ``num_train_epochs``); ``resume_from_checkpoint`` (True: the newest in
        output_dir; "auto": that or a fresh start; a path) continues that run exactly. The folder is claimed first."""
        args = self.args
        resume_path = resume.resolve(resume_from_checkpoint, args.output_dir, args.ignore_checkpoint_fingerprints)
        auto, main, resumed = resume_from_checkpoint == resume.AUTO, dist.is_main_process(), resume_path is not None
        compilation.check_settings(args)  # torch_compile's backend, mode and compiler, before the folder is claimed
        keep = args.keep_freed_memory and args.device.type == "cpu"  # for the run only (a departure: allocator.py)
        with runs.claim_run_folder(args, resume=resumed, model=self.model, main_process=main, auto=auto):
            with freed_memory_kept() if keep else contextlib.nullcontext():
                return self._train(resume_path)

    def _train(self, resume_path: str | None) -> TrainOutput:
        args = self.args
        dist.init_distributed(args.device, args.ddp_timeout)
        ckpt.set_seed(args.seed)
        data.require_eval_dataset(args, self.eval_dataset)
        if args.gradient_checkpointing:
            models.enable_gradient_checkpointing(dist.unwrap_model(self.model), args.gradient_checkpointing_kwargs)
        compilation.compile_for_training(self)  # args.torch_compile
        self.prepare_training()
        self.callback_handler.train_dataloader = dataloader = self.get_train_dataloader()
        base = dist.unwrap_model(self.model)
        needs_labels = type(self).compute_loss is Trainer.compute_loss and hasattr(base, "config")
        data.check_first_batch(dataloader, self.args.label_names if needs_labels else None)
        steps_per_epoch, max_steps, num_epochs = data.plan_steps(dataloader, args, self.micro_batches_per_batch())
        self.model_wrapped = dist.wrap_model(self.model, args)
        self.create_optimizer()
        self.create_scheduler(max_steps, self.optimizer)
        self._start_run(steps_per_epoch, max_steps, num_epochs, resume_path)
        handler = self.callback_handler
        handler.model, handler.optimizer, handler.lr_scheduler = self.model, self.optimizer, self.lr_scheduler
        self.model_wrapped.train()
        start_step, start_time = self.state.global_step, time.time()
        with self.preemption.guard() if self.preemption in handler.callbacks else contextlib.nullcontext():
            self.control._new_training()
            self._event("on_train_begin")
            self._act_on_control()  # e.g. eval_on_start (FlowCallback)
            first_epoch, skip_steps = divmod(self.state.global_step, steps_per_epoch)
            for epoch in range(first_epoch, num_epochs):
                if self.control.should_training_stop or self.state.global_step >= max_steps:
                    break
                with self.preemption.abandoned_step(self.state, self.control):
                    self._train_epoch(dataloader, epoch, skip_steps if epoch == first_epoch else 0)
            self._act_on_control()  # the save a step left to a signal asks for (PreemptionCallback.abandoned_step)
        return self._finish_training(start_step, start_time)

    def _start_run(self, steps_per_epoch: int, max_steps: int, num_epochs: int, resume_path: str | None) -> None:
        plan = dict(steps_per_epoch=steps_per_epoch, max_steps=max_steps, num_train_epochs=num_epochs)
        self.state, self.loop = TrainerState.for_run(self.args, **plan, trainer=self), LoopState()
        self.metrics.clear()
        if resume_path is not None:
            self._resume(resume_path)

    def micro_batches_per_batch(self) -> int:
        """Micro-batches one batch of the training dataloader feeds (1; GRPO: ``steps_per_generation * μ``)."""
        return 1

    def training_windows(self, dataloader, epoch: int, skip_steps: int) -> Iterator[list]:
        """The accumulation windows (``gradient_accumulation_steps`` micro-batches each) of epoch ``epoch`` from
        its step ``skip_steps`` on. GRPO overrides it so that one generation batch feeds several steps."""
        accum = self.args.gradient_accumulation_steps
        batches = data.epoch_batches(dataloader, epoch, skip_steps * accum)
        while window := list(itertools.islice(batches, accum)):
            yield window

    def _train_epoch(self, dataloader, epoch: int, skip_steps: int) -> None:
        self.control._new_epoch()
        self._event("on_epoch_begin")
        windows = self.training_windows(dataloader, epoch, skip_steps)
        for step_in_epoch, window in zip(range(skip_steps, self.state.steps_per_epoch), windows):
            self._optimizer_step(window)
            self.state.epoch = epoch + (step_in_epoch + 1) / self.state.steps_per_epoch
            self._event("on_step_end")
            # at an epoch's last step a save waits for on_epoch_end: a run resumed from that checkpoint starts the
            # next epoch, so the checkpoint must already hold what the epoch's end logged, evaluated or counted
            self._act_on_control(defer_save=step_in_epoch == self.state.steps_per_epoch - 1)
            if self.control.should_epoch_stop or self.control.should_training_stop:
                break
        self._event("on_epoch_end")
        self._act_on_control()

    def prepare_window(self, batch_samples: list) -> list:
        """The micro-batches one optimizer step trains on, from its window's raw micro-batches; called once per
        step, before items are counted. The default returns them as they are (GRPO samples and scores here)."""
        return batch_samples

    def _optimizer_step(self, window: list) -> None:
        """One optimizer step over the micro-batches of an accumulation window."""
        self.control._new_step()
        self._event("on_step_begin")
        window = self.prepare_window(window)
        self.state.num_input_tokens_seen += count_input_tokens(window, self.args, self.processing_class)
        if self.logs_num_tokens:
            pad = getattr(self.processing_class, "pad_token_id", None)  # read only for a batch without a mask
            record_num_tokens(self.metrics, input_tokens(window, "non_padding", pad))
        self.loop.window_size = len(window)
        num_items = self.get_num_items_in_batch(window)
        losses = []
        for i, inputs in enumerate(window):
            last = i == len(window) - 1
            self.loop.micro_batch = inputs
            with dist.no_sync(self.model_wrapped, skip_sync=not last):
                losses.append(self.training_step(self.model_wrapped, inputs, num_items))
            if not last:
                self._event("on_substep_end")
        self.loop.micro_batch, self.loop.window_size = None, 1  # a lone training_step after this: one micro-batch
        step_loss = torch.stack(losses).double().sum()
        if not (self.args.skip_nonfinite_steps and skip_nonfinite_step(step_loss, self.state, self.args)):
            record_loss(self.metrics, step_loss, num_items, items_are_global=self.items_are_global())
            self._event("on_pre_optimizer_step")
            if self.args.max_grad_norm > 0:
                self.loop.grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
            self.optimizer.step()
            self._event("on_optimizer_step")
            self.loop.learning_rate = float(self.lr_scheduler.get_last_lr()[0])  # the step's lr (torchao's: a tensor)
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.global_step += 1

    def _act_on_control(self, defer_save: bool = False) -> None:
        """Log, evaluate and save as the callbacks asked; clear the flags (``should_save`` lives on if deferred)."""
        step = self.state.global_step
        if self.control.should_log:
            self._log_training_window()
        if self.control.should_evaluate:
            self.loop.last_eval = (step, self.evaluate())
            self.model_wrapped.train()
        if self.control.should_save and not defer_save and step != self.loop.last_saved_step:
            eval_step, metrics = self.loop.last_eval
            self._save_checkpoint(metrics if eval_step == step else None)
        self.control.should_log = self.control.should_evaluate = False
        self.control.should_save = self.control.should_save and defer_save

    # ---- logging ------------------------------------------------------------------------------------------
    def _log_training_window(self) -> None:
        """Log the mean loss and the means of every recorded metric since the last log (one all-reduce)."""
        logs = training_logs(self.metrics, self.state, self.loop.grad_norm, self.loop.learning_rate)
        if logs is not None:
            self.log(logs)

    def log(self, logs: dict[str, float]) -> None:
        """Record ``logs`` in ``state.log_history`` and fire ``on_log`` (printers, metrics.jsonl, trackers).
        Override to add or reshape metrics; call ``super().log(logs)`` at the end."""
        if self.args.include_num_input_tokens_seen != "no":
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self._event("on_log", logs=logs)

    def _finish_training(self, start_step: int, start_time: float) -> TrainOutput:
        if "loss" in self.metrics.names("train"):  # steps not logged yet still count in train_loss
            check_logged_loss(fold_loss(self.state, self.metrics.reduce("train")["loss"]), self.state)
        args, steps = self.args, self.state.global_step - start_step
        samples = steps * data.step_rows(args, self.callback_handler.train_dataloader)  # capped at the rows there are
        metrics = speed_metrics(start_time, steps, samples, self.state)
        self.log(metrics)
        if args.load_best_model_at_end and self.state.best_model_checkpoint:
            ckpt.load_weights(self.model, self.state.best_model_checkpoint)
        self._event("on_train_end")
        self.preemption.raise_if_stopped(args, self.state)  # a signal: its checkpoint is written, its message printed
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    # ---- checkpoints --------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None) -> None:
        """Save the weights (save_pretrained layout; a PEFT model's adapter), the processing class and the args."""
        ckpt.export_model(self.model, output_dir or self.args.output_dir, self.processing_class, self.args)

    def _save_checkpoint(self, metrics: dict | None) -> None:
        # a preempted run must be resumable: its last checkpoint is whole even with save_only_model
        weights_only = self.args.save_only_model and not self.preemption.stopped
        ckpt.save_run_checkpoint(
            self.args,
            self.state,
            metrics,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.lr_scheduler,
            processing_class=self.processing_class,
            save_only_model=weights_only,
            extra_state={
                "metrics": self.metrics.state_dict(),
                "data": stream_state(self.callback_handler.train_dataloader),
                "trainer": self.extra_checkpoint_state(),
            },
        )
        self.loop.last_saved_step = self.state.global_step
        self._event("on_save")

    def _resume(self, path: str) -> None:
        """Continue the run in ``path`` (weights, optimizer, scheduler, RNG, state, metrics, extra state)."""
        stream = stream_state(self.callback_handler.train_dataloader) is not None
        state = resume.resumed_state(path, self.state, self.args, stream=stream)
        ckpt.load_checkpoint(path, model=self.model, optimizer=self.optimizer, scheduler=self.lr_scheduler)
        self.state, self.loop.last_saved_step = state, state.global_step
        metrics, extra = resume.read_run_extra(path, state)
        restore_stream(self.callback_handler.train_dataloader, (ckpt.load_extra_state(path) or {}).get("data"))
        self.metrics.load_state_dict(metrics)
        if extra is not None:
            self.load_extra_checkpoint_state(extra)

    def extra_checkpoint_state(self) -> dict | None:
        """This rank's extra state to keep in each checkpoint (tensors, numbers, strings in lists / dicts), e.g.
        GRPO's generation buffer; written inside the checkpoint's atomic save. None (the default) saves nothing."""

    def load_extra_checkpoint_state(self, state: dict) -> None:
        """Restore what ``extra_checkpoint_state`` returned, when resuming (after weights, optimizer, RNG,
        ``self.state`` and the metrics window are restored)."""
