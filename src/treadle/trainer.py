"""The Trainer: a short, fixed training loop whose every step is a method you can override.

Override a method to change *what* happens, register a callback (treadle.callbacks) to change *when and
whether* it happens. The overridable methods, in the order a run calls them:

=======================  ==========================================================================
``get_train_dataloader`` once per ``train()``: what a micro-batch is (GRPO loads several steps' prompts)
``create_optimizer``     once, unless ``optimizers=(opt, sched)`` was given
``create_scheduler``     once, after the optimizer
``get_num_items_in_batch`` once per optimizer step, with the raw micro-batches of the accumulation window
``training_step``        per micro-batch: ``prepare_inputs`` -> ``compute_loss`` -> backward
``prepare_inputs``       per micro-batch: move to the device (GRPO generates and scores here)
``compute_loss``         per micro-batch: the loss, summed over items / ``num_items_in_batch``
``log``                  when a callback sets ``control.should_log``
``evaluate``             when ``control.should_evaluate``: ``get_eval_dataloader`` + ``prediction_step``
``save_model``           by you (final weights); checkpoints are written when ``control.should_save``
=======================  ==========================================================================

The loop itself is ``train`` -> ``_train_epoch`` -> ``_optimizer_step``; see treadle.callbacks for the event
order. Names and signatures follow ``transformers.Trainer``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import random
import signal
import sys
import threading
import time
from typing import Any, NamedTuple

import torch

from treadle import checkpoint as ckpt
from treadle import distributed as dist
from treadle.arguments import TrainingArguments
from treadle.callbacks import (DEFAULT_CALLBACKS, CallbackHandler, PrinterCallback, ProgressCallback,
                               TensorBoardCallback, TrainerControl, TrainerState)
from treadle.data import (SeededSampler, collator_for, column_names, forward_parameters, unused_columns)
from treadle.optim import build_optimizer, build_scheduler


class EvalPrediction(NamedTuple):
    """What ``compute_metrics`` receives: numpy arrays gathered over the evaluation set (padded with -100)."""

    predictions: Any
    label_ids: Any


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict[str, float]


class PredictionOutput(NamedTuple):
    predictions: Any
    label_ids: Any
    metrics: dict[str, float]


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """Trains ``model`` on ``train_dataset`` with ``args``; see the module docstring for what to override.

    ``model`` is a transformers ``PreTrainedModel`` or any ``nn.Module`` whose output has a ``loss`` (a dict
    key, attribute, or first tuple element) — or whose loss a subclass computes in ``compute_loss``.
    """

    def __init__(self, model=None, args: TrainingArguments | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None)):
        if model is None:
            raise ValueError("Trainer needs a model")
        self.args = args if args is not None else TrainingArguments()
        dist.init_distributed(self.args.device, self.args.ddp_timeout)  # under torchrun: the group exists before any data work
        self.model = model.to(self.args.device)
        self.model_wrapped = self.model  # the DDP / FSDP wrapper once train() has wrapped it
        self.processing_class = processing_class
        self.data_collator = data_collator if data_collator is not None else collator_for(processing_class)
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.compute_metrics = compute_metrics
        self.optimizer, self.lr_scheduler = optimizers
        self.state = TrainerState()
        self.control = TrainerControl()
        self.callback_handler = CallbackHandler(self._default_callbacks() + list(callbacks or []), self.model,
                                                processing_class, self.optimizer, self.lr_scheduler)
        self._forward_params = forward_parameters(self.model)
        self._stop_signal: int | None = None
        self._micro_items: int | None = None  # items of the micro-batch in training_step, counted before it moves
        self._dropped_columns_logged: set[str] = set()
        self.control = self.callback_handler.call_event("on_init_end", self.args, self.state, self.control)

    def _default_callbacks(self) -> list:
        reporting = [ProgressCallback() if not self.args.disable_tqdm else PrinterCallback()]
        if {"tensorboard", "all"} & set(self.args.report_to):
            reporting.append(TensorBoardCallback())
        return [cb() for cb in DEFAULT_CALLBACKS] + reporting

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
    def get_train_dataloader(self):
        """The training DataLoader: ``per_device_train_batch_size`` rows, shuffled by a seeded sampler that can
        resume mid-epoch. Override to change what one micro-batch is."""
        if self.train_dataset is None:
            raise ValueError("Trainer.train() needs a train_dataset")
        dataset = self.remove_unused_columns(self.train_dataset, "training")
        sampler = self.build_sampler(dataset, shuffle=True)
        return self.build_dataloader(dataset, batch_size=self.args.per_device_train_batch_size, sampler=sampler,
                                     drop_last=self.args.dataloader_drop_last)

    def get_eval_dataloader(self, eval_dataset=None):
        """The evaluation DataLoader over ``eval_dataset`` (or the Trainer's), in order, split across ranks."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (pass one to Trainer or to evaluate)")
        return self._ordered_dataloader(dataset, "evaluation")

    def get_test_dataloader(self, test_dataset):
        """The prediction DataLoader over ``test_dataset``, in order, split across ranks."""
        return self._ordered_dataloader(test_dataset, "prediction")

    def _ordered_dataloader(self, dataset, description: str):
        dataset = self.remove_unused_columns(dataset, description)
        sampler = self.build_sampler(dataset, shuffle=False) if hasattr(dataset, "__len__") else None
        return self.build_dataloader(dataset, batch_size=self.args.per_device_eval_batch_size, sampler=sampler)

    def build_sampler(self, dataset, *, shuffle: bool):
        """A SeededSampler over ``dataset`` for this rank (None for an iterable dataset)."""
        if not hasattr(dataset, "__len__"):
            return None
        return SeededSampler(len(dataset), seed=self.args.data_seed, shuffle=shuffle,
                             rank=dist.get_rank(), world_size=dist.get_world_size())

    def build_dataloader(self, dataset, *, batch_size: int, sampler=None, collate_fn=None, drop_last=False):
        """A DataLoader with the Trainer's collator and worker settings. Its own generator keeps the global
        torch RNG untouched, so that starting an epoch mid-way (resume) draws the same dropout masks."""
        from torch.utils.data import DataLoader

        return DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                          collate_fn=collate_fn or self.data_collator, drop_last=drop_last,
                          num_workers=self.args.dataloader_num_workers,
                          pin_memory=self.args.dataloader_pin_memory and self.args.device.type == "cuda",
                          generator=torch.Generator().manual_seed(self.args.data_seed))

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
        keep = self.signature_columns()
        if not self.args.remove_unused_columns or keep is None or column_names(dataset) is None:
            return dataset
        dropped = unused_columns(dataset, keep)
        if not dropped:
            return dataset
        if len(dropped) == len(column_names(dataset)):
            raise ValueError(f"none of the {description} dataset's columns {dropped} is an argument of "
                             f"{type(dist.unwrap_model(self.model)).__name__}.forward (it takes "
                             f"{sorted(keep)}); tokenize the dataset first, or set remove_unused_columns=False "
                             f"and pass a data_collator that builds the model's inputs")
        key = f"{description}:{','.join(dropped)}"
        if key not in self._dropped_columns_logged and dist.is_main_process():
            self._dropped_columns_logged.add(key)
            print(f"treadle: dropping {description} dataset columns {dropped} that "
                  f"{type(dist.unwrap_model(self.model)).__name__}.forward does not take "
                  f"(set remove_unused_columns=False to keep them)", file=sys.stderr)
        return dataset.remove_columns(dropped)

    def _check_first_batch(self, dataloader) -> None:
        """Collate the first rows before training so a data problem fails at once, naming the columns."""
        dataset = dataloader.dataset
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__") or len(dataset) == 0:
            if hasattr(dataset, "__len__") and len(dataset) == 0:
                raise ValueError("the training dataset is empty")
            return
        rows = [dataset[i] for i in range(min(2, len(dataset)))]
        try:
            batch = dataloader.collate_fn(rows)
        except Exception as e:
            raise ValueError(f"the data collator failed on the first training rows (columns: "
                             f"{column_names(dataset) or list(rows[0]) if isinstance(rows[0], dict) else '?'}): "
                             f"{type(e).__name__}: {e}") from e
        if type(self).compute_loss is Trainer.compute_loss and isinstance(batch, dict):
            labels = [k for k in self.args.label_names if k in batch]
            if not labels and hasattr(dist.unwrap_model(self.model), "config"):
                raise ValueError(f"the model needs {self.args.label_names} to compute its loss but the training "
                                 f"batches only have {sorted(batch)}; add a labels column (for causal LMs, "
                                 f"labels = input_ids with -100 on ignored tokens), or override compute_loss")

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
                self.args.lr_scheduler_type, optimizer or self.optimizer,
                num_warmup_steps=self.args.num_warmup_steps(num_training_steps),
                num_training_steps=num_training_steps)
        return self.lr_scheduler

    # ---- the loss -----------------------------------------------------------------------------------------
    def count_items(self, inputs: dict) -> int | None:
        """Loss items in one micro-batch: label tokens that are not -100 (shifted by one for causal LMs,
        whose first token is never predicted). None when the batch has no labels."""
        labels = inputs.get(self.args.label_names[0]) if isinstance(inputs, dict) else None
        if not isinstance(labels, torch.Tensor):
            return None
        if labels.dim() >= 2 and self._shifts_labels():
            labels = labels[..., 1:]
        return int(labels.ne(-100).sum())

    def _shifts_labels(self) -> bool:
        name = type(dist.unwrap_model(self.model)).__name__
        return name.endswith("ForCausalLM") or name.endswith("LMHeadModel")

    def get_num_items_in_batch(self, batch_samples: list) -> int | None:
        """Items (e.g. label tokens) in one whole accumulation window, summed over all ranks; the loss of each
        micro-batch is divided by it, so accumulation and data parallelism give the big batch's gradient.
        Called once per optimizer step with the raw micro-batches, before any ``training_step``."""
        counts = [self.count_items(b) for b in batch_samples]
        if any(c is None for c in counts):
            return None
        total = sum(counts)
        if dist.get_world_size() > 1 and self.args.average_tokens_across_devices:
            total = int(dist.all_reduce_sum(torch.tensor(total, device=self.args.device)).item())
        return total

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The loss of one micro-batch: summed over its items and divided by ``num_items_in_batch`` (items of
        the whole window, all ranks). With ``num_items_in_batch=None``, the model's own mean loss.

        A forward that names a ``num_items_in_batch`` argument receives it and must return that sum / count.
        Any other model returns its mean over the micro-batch's items (``count_items``), which is rescaled
        here to its share of the window: exact for transformers models, no model-specific detection needed.
        """
        kwargs = {}
        if self._forward_params is not None and "use_cache" in self._forward_params and "use_cache" not in inputs:
            kwargs["use_cache"] = False  # a training forward has no use for a KV cache
        takes_items = self._forward_params is not None and "num_items_in_batch" in self._forward_params
        if num_items_in_batch is not None and takes_items:
            kwargs["num_items_in_batch"] = num_items_in_batch
        outputs = model(**inputs, **kwargs)
        loss = _loss_of(outputs, inputs)
        if num_items_in_batch is not None and not takes_items:
            # counted on the raw CPU batch by the loop (no device sync here); a direct call counts now
            items = self._micro_items if self._micro_items is not None else self.count_items(inputs)
            # no item in this micro-batch: the model's mean is 0/0; it contributes nothing to the window
            loss = loss * (items / num_items_in_batch) if items else loss.new_zeros(())
        return (loss, outputs) if return_outputs else loss

    def prepare_inputs(self, inputs):
        """Move one micro-batch to the device. Subclasses may build inputs here (GRPO generates and scores)."""
        device = self.args.device
        if isinstance(inputs, dict):
            return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                    for k, v in inputs.items()}
        return inputs

    def autocast(self):
        """bfloat16 autocast around forwards when ``args.bf16`` (CPU and GPU); a no-op otherwise."""
        if not self.args.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.args.device.type, dtype=torch.bfloat16)

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """One micro-batch: prepare, forward, backward. Returns the detached loss (its share of the window)."""
        inputs = self.prepare_inputs(inputs)
        with self.autocast():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if num_items_in_batch is None:
            loss = loss / self._micro_steps  # the model's mean per micro-batch: average them over the window
        # DDP averages gradients over ranks, but num_items_in_batch already counts every rank's items
        scale = dist.get_world_size() if num_items_in_batch is not None and self.args.average_tokens_across_devices else 1
        if loss.requires_grad:
            (loss * scale if scale != 1 else loss).backward()
        return loss.detach()

    # ---- the loop -----------------------------------------------------------------------------------------
    @dist.rank_errors  # under torchrun an exception names the rank that raised it
    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """Train for ``max_steps`` (or ``num_train_epochs``); with ``resume_from_checkpoint`` (True: the
        newest in output_dir, or a path) continue that run exactly where it stopped."""
        args = self.args
        dist.init_distributed(args.device, args.ddp_timeout)
        set_seed(args.seed)
        if args.gradient_checkpointing:
            self._enable_gradient_checkpointing()
        dataloader = self.get_train_dataloader()
        self._check_first_batch(dataloader)
        steps_per_epoch, max_steps, num_epochs = self._plan(dataloader)
        self.model_wrapped = dist.wrap_model(self.model, args)
        self.create_optimizer()
        self.create_scheduler(max_steps, self.optimizer)
        self.state = TrainerState(max_steps=max_steps, num_train_epochs=num_epochs, steps_per_epoch=steps_per_epoch,
                                  logging_steps=args.logging_steps, eval_steps=args.eval_steps,
                                  save_steps=args.save_steps, train_batch_size=args.per_device_train_batch_size,
                                  gradient_accumulation_steps=args.gradient_accumulation_steps,
                                  world_size=dist.get_world_size(), is_world_process_zero=dist.is_main_process(),
                                  is_local_process_zero=args.local_process_index == 0)
        self._last_saved_step, self._last_eval = None, (None, None)
        path = ckpt.resolve(resume_from_checkpoint, args.output_dir)
        if path is not None:
            self._resume(path)
        handler = self.callback_handler
        handler.model, handler.optimizer, handler.lr_scheduler = self.model, self.optimizer, self.lr_scheduler
        handler.train_dataloader = dataloader
        self.model_wrapped.train()
        self._reset_log_window()
        self._restore_log_window()
        start_step, start_time = self.state.global_step, time.time()
        with self._preemption_guard():
            self.control._new_training()
            self._event("on_train_begin")
            first_epoch, skip_steps = divmod(self.state.global_step, steps_per_epoch)
            for epoch in range(first_epoch, num_epochs):
                if self.control.should_training_stop or self.state.global_step >= max_steps:
                    break
                self._train_epoch(dataloader, epoch, skip_steps if epoch == first_epoch else 0)
        return self._finish_training(start_step, start_time)

    def _plan(self, dataloader) -> tuple[int, int, int]:
        """(optimizer steps per epoch, total steps, epochs) from the dataloader length and the arguments."""
        args, accum = self.args, self.args.gradient_accumulation_steps
        try:
            batches = len(dataloader)
        except TypeError:
            if args.max_steps <= 0:
                raise ValueError("the training dataset has no length (an iterable dataset): set max_steps") from None
            return args.max_steps, args.max_steps, 1
        if batches == 0:
            raise ValueError(f"the training dataloader is empty: {len(dataloader.dataset)} rows with batch size "
                             f"{dataloader.batch_size} and drop_last={dataloader.drop_last}")
        steps_per_epoch = math.ceil(batches / accum)
        if args.max_steps > 0:
            return steps_per_epoch, args.max_steps, math.ceil(args.max_steps / steps_per_epoch)
        return steps_per_epoch, math.ceil(args.num_train_epochs * steps_per_epoch), math.ceil(args.num_train_epochs)

    def _train_epoch(self, dataloader, epoch: int, skip_steps: int) -> None:
        accum = self.args.gradient_accumulation_steps
        batches = self._epoch_iterator(dataloader, epoch, skip_steps * accum)
        self.control._new_epoch()
        self._event("on_epoch_begin")
        for step_in_epoch in range(skip_steps, self.state.steps_per_epoch):
            window = list(itertools.islice(batches, accum))
            if not window:
                break
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

    def _epoch_iterator(self, dataloader, epoch: int, skip_batches: int):
        """Iterate one epoch from batch ``skip_batches``: the sampler skips without loading when it can
        (``set_epoch(epoch, skip)``), else the skipped batches are loaded and dropped."""
        sampler = getattr(dataloader, "sampler", None)
        batch_size = getattr(dataloader, "batch_size", None)
        if hasattr(sampler, "set_epoch") and "skip" in sampler.set_epoch.__code__.co_varnames and batch_size:
            sampler.set_epoch(epoch, skip_batches * batch_size)
            return iter(dataloader)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        return itertools.islice(iter(dataloader), skip_batches, None)

    def _optimizer_step(self, window: list) -> None:
        """One optimizer step over the micro-batches of an accumulation window."""
        self.control._new_step()
        self._event("on_step_begin")
        self._micro_steps = len(window)
        num_items = self.get_num_items_in_batch(window)
        for i, inputs in enumerate(window):
            last = i == len(window) - 1
            self._micro_items = self.count_items(inputs) if num_items is not None else None
            with dist.no_sync(self.model_wrapped, skip_sync=not last):
                loss = self.training_step(self.model_wrapped, inputs, num_items)
            self._micro_items = None
            # item-weighted, so that the logged loss is the mean over all items of the logging window
            self._log_loss_sum += loss.double() * (num_items if num_items is not None else 1 / dist.get_world_size())
            if not last:
                self._event("on_substep_end")
        self._log_items += num_items if num_items is not None else 1.0
        self._event("on_pre_optimizer_step")
        if self.args.max_grad_norm > 0:
            self._last_grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
        self.optimizer.step()
        self._event("on_optimizer_step")
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.global_step += 1

    def _act_on_control(self, defer_save: bool = False) -> None:
        """Log, evaluate and save as the callbacks asked (or as a stop signal demands), then clear the flags
        (``should_save`` survives when ``defer_save``)."""
        if self._stop_signal is not None or dist.get_world_size() > 1:
            if dist.any_rank(self._stop_signal is not None, self.args.device):
                self.control.should_save = True  # even with save_strategy="no": a preempted run keeps its work
                self.control.should_training_stop = True
                self._stop_signal = self._stop_signal or signal.SIGTERM
        step = self.state.global_step
        if self.control.should_log:
            self._log_training_window()
        if self.control.should_evaluate:
            self._last_eval = (step, self.evaluate())
            self.model_wrapped.train()
        if self.control.should_save and not defer_save and step != self._last_saved_step:
            eval_step, metrics = self._last_eval
            self._save_checkpoint(metrics if eval_step == step else None)
        self.control.should_log = self.control.should_evaluate = False
        self.control.should_save = self.control.should_save and defer_save

    # ---- logging ------------------------------------------------------------------------------------------
    def _reset_log_window(self) -> None:
        self._log_loss_sum = torch.zeros((), dtype=torch.float64, device=self.args.device)
        self._log_items = 0.0
        self._last_grad_norm = None

    def _restore_log_window(self) -> None:
        pending, self._pending_log_window = getattr(self, "_pending_log_window", None), None
        if pending:
            if dist.is_main_process():  # the saved sum is already reduced over ranks: add it once
                self._log_loss_sum.fill_(pending["loss_sum"])
            self._log_items = pending["items"]

    def _flush_log_window(self) -> float | None:
        """Fold the item-weighted loss of the steps since the last log into the run totals; return its mean."""
        if self._log_items == 0:
            return None
        total = dist.all_reduce_sum(self._log_loss_sum.clone()).item()
        items = self._log_items  # num_items is already a sum over ranks
        self.state.total_loss_sum += total
        self.state.total_loss_items += items
        self._log_loss_sum.zero_()
        self._log_items = 0.0
        return total / items

    def _log_training_window(self) -> None:
        loss = self._flush_log_window()
        if loss is None:
            return
        logs = {"loss": loss}
        if self._last_grad_norm is not None:
            logs["grad_norm"] = float(self._last_grad_norm)
        logs["learning_rate"] = self.lr_scheduler.get_last_lr()[0]
        self.log(logs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Record ``logs`` in ``state.log_history`` and fire ``on_log`` (printers, metrics.jsonl, TensorBoard).
        Override to add or reshape metrics; call ``super().log(logs)`` at the end."""
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self._event("on_log", logs=logs)

    def _finish_training(self, start_step: int, start_time: float) -> TrainOutput:
        if self._log_items:
            self._flush_log_window()
        runtime = time.time() - start_time
        steps = self.state.global_step - start_step
        args = self.args
        samples = steps * args.per_device_train_batch_size * args.gradient_accumulation_steps * dist.get_world_size()
        train_loss = self.state.total_loss_sum / self.state.total_loss_items if self.state.total_loss_items else float("nan")
        metrics = {"train_runtime": round(runtime, 4), "train_samples_per_second": round(samples / max(runtime, 1e-9), 3),
                   "train_steps_per_second": round(steps / max(runtime, 1e-9), 3), "train_loss": train_loss}
        self.log(metrics)
        if args.load_best_model_at_end and self.state.best_model_checkpoint:
            ckpt.load_weights(self.model, self.state.best_model_checkpoint)
        self._event("on_train_end")
        if self._stop_signal is not None:
            self._exit_after_preemption()
        return TrainOutput(self.state.global_step, train_loss, metrics)

    # ---- evaluation ---------------------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Loss (item-weighted mean) and ``compute_metrics`` over the evaluation set; logs the metrics and fires
        ``on_evaluate``. Returns ``{prefix}_loss``, ``{prefix}_<metric>`` ..."""
        dataloader = self.get_eval_dataloader(eval_dataset)
        self.callback_handler.eval_dataloader = dataloader
        output = self.evaluation_loop(dataloader, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        self.log(output.metrics)
        self._event("on_evaluate", metrics=output.metrics)
        return output.metrics

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test") -> PredictionOutput:
        """Predictions (numpy, padded with -100), labels and metrics on ``test_dataset``; fires ``on_predict``."""
        dataloader = self.get_test_dataloader(test_dataset)
        self.callback_handler.eval_dataloader = dataloader
        output = self.evaluation_loop(dataloader, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix,
                                      prediction_loss_only=False)
        self._event("on_predict", metrics=output.metrics)
        return output

    def evaluation_loop(self, dataloader, *, ignore_keys=None, metric_key_prefix="eval",
                        prediction_loss_only=None) -> PredictionOutput:
        """Run ``prediction_step`` over ``dataloader``, moving predictions to the CPU batch by batch."""
        model = self.model_wrapped
        was_training = model.training
        model.eval()
        if prediction_loss_only is None:  # evaluate(): logits are gathered only when compute_metrics wants them
            prediction_loss_only = self.args.prediction_loss_only or self.compute_metrics is None
        loss_only = prediction_loss_only
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.args.device)
        weight_sum, preds, labels = 0.0, [], []
        # under several processes the sampler repeats a few rows so that every rank runs as many forwards; those
        # rows get their labels masked (no weight in the loss) and are cut from the predictions
        real_rows = getattr(getattr(dataloader, "sampler", None), "num_real_rows", lambda: None)()
        seen = 0
        for inputs in dataloader:
            rows = _batch_rows(inputs)
            keep = None if real_rows is None or seen + rows <= real_rows else max(0, real_rows - seen)
            seen += rows
            if keep is not None:
                inputs = self._mask_label_rows(inputs, keep)
            items = self.count_items(inputs)
            weight = items if items is not None else (rows if keep is None else keep)
            loss, logits, label = self.prediction_step(model, inputs, loss_only, ignore_keys=ignore_keys)
            if loss is not None and weight:
                loss_sum += loss.double() * weight
                weight_sum += weight
            if logits is not None:
                preds.append(_to_cpu(logits)[:keep])
            if label is not None:
                labels.append(_to_cpu(label)[:keep])
            self._event("on_prediction_step")
        model.train(was_training)
        metrics = {}
        weight_sum = float(dist.all_reduce_sum(torch.tensor(weight_sum, dtype=torch.float64, device=self.args.device)))
        if weight_sum:
            metrics["loss"] = dist.all_reduce_sum(loss_sum).item() / weight_sum
        predictions = _gather_and_pad(preds) if preds else None
        label_ids = _gather_and_pad(labels) if labels else None
        if self.compute_metrics is not None and predictions is not None and label_ids is not None:
            metrics.update(self.compute_metrics(EvalPrediction(predictions, label_ids)))
        metrics = {k if k.startswith(f"{metric_key_prefix}_") else f"{metric_key_prefix}_{k}": _to_float(v)
                   for k, v in metrics.items()}
        return PredictionOutput(predictions, label_ids, metrics)

    def _mask_label_rows(self, inputs, keep: int):
        labels = inputs.get(self.args.label_names[0]) if isinstance(inputs, dict) else None
        if not isinstance(labels, torch.Tensor):
            return inputs
        labels = labels.clone()
        labels[keep:] = -100
        return {**inputs, self.args.label_names[0]: labels}

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys=None):
        """(loss, logits, labels) for one evaluation batch, without gradients. The loss is the model's mean over
        the batch's items; logits are the model's outputs other than the loss (and ``ignore_keys``)."""
        inputs = self.prepare_inputs(inputs)
        has_labels = isinstance(inputs, dict) and all(inputs.get(k) is not None for k in self.args.label_names)
        with torch.no_grad(), self.autocast():
            if has_labels:
                loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
                loss = loss.detach().float()
            else:
                loss, outputs = None, model(**inputs)
        if prediction_loss_only:
            return loss, None, None
        logits = _logits_of(outputs, ignore_keys)
        labels = inputs[self.args.label_names[0]] if has_labels else None
        return loss, logits, labels

    # ---- checkpoints --------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None) -> None:
        """Save the weights (save_pretrained layout for transformers models) and the processing class."""
        output_dir = output_dir or self.args.output_dir
        full_weights = dist.full_state_dict(self.model)  # FSDP2: gathered on rank 0 (all ranks take part)
        if dist.is_main_process():
            os.makedirs(output_dir, exist_ok=True)
            ckpt.save_weights(self.model, output_dir, state_dict=full_weights)
            if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
                self.processing_class.save_pretrained(output_dir)
        dist.barrier()

    def _save_checkpoint(self, metrics: dict | None) -> None:
        self._flush_log_window_for_checkpoint()
        path = os.path.join(self.args.output_dir, f"{ckpt.PREFIX}{self.state.global_step}")
        self._update_best(metrics, path)
        # a preempted run must be resumable: its last checkpoint is whole even with save_only_model
        weights_only = self.args.save_only_model and self._stop_signal is None
        ckpt.save_checkpoint(self.args.output_dir, model=self.model, optimizer=self.optimizer,
                             scheduler=self.lr_scheduler, state=self.state, args=self.args,
                             processing_class=self.processing_class, save_only_model=weights_only,
                             extra_state=self.extra_checkpoint_state())
        if dist.is_main_process():
            # the checkpoint just written is kept even when it is not the highest step (a run resumed from an
            # older checkpoint while later ones exist)
            ckpt.rotate(self.args.output_dir, self.args.save_total_limit,
                        keep=(self.state.best_model_checkpoint, path))
        self._last_saved_step = self.state.global_step
        self._event("on_save")

    def _flush_log_window_for_checkpoint(self) -> None:
        # the loss of steps not yet logged is saved in the state, so a resumed run logs the same window mean
        if self._log_items:
            pending = dist.all_reduce_sum(self._log_loss_sum.clone()).item()
            self.state.stateful_callbacks["_log_window"] = {"loss_sum": pending, "items": self._log_items}
        else:
            self.state.stateful_callbacks.pop("_log_window", None)

    def _update_best(self, metrics: dict | None, path: str) -> None:
        key = self.args.metric_for_best_model
        if key is None or not metrics:
            return
        key = key if key.startswith("eval_") else f"eval_{key}"
        if key not in metrics:
            raise KeyError(f"metric_for_best_model={self.args.metric_for_best_model!r} is not among the evaluation "
                           f"metrics {sorted(metrics)}")
        value, best = metrics[key], self.state.best_metric
        better = best is None or (value > best if self.args.greater_is_better else value < best)
        if better:
            self.state.best_metric, self.state.best_global_step = value, self.state.global_step
            self.state.best_model_checkpoint = path

    def _resume(self, path: str) -> None:
        state = ckpt.read_state(path)  # checked before anything is loaded: a refusal leaves the model as it was
        mismatches = [f"{name}: checkpoint {getattr(state, name)} vs now {getattr(self.state, name)}"
                      for name in ("train_batch_size", "gradient_accumulation_steps", "world_size", "steps_per_epoch")
                      if getattr(state, name) != getattr(self.state, name)]
        if mismatches:
            raise ckpt.CheckpointError(f"cannot resume {path!r} exactly: {'; '.join(mismatches)}. Resume with the "
                                       f"same batch size, accumulation, number of processes and dataset, or start "
                                       f"a new run from its weights (model.from_pretrained({path!r}))")
        ckpt.load_checkpoint(path, model=self.model, optimizer=self.optimizer, scheduler=self.lr_scheduler)
        for name in ("max_steps", "num_train_epochs", "logging_steps", "eval_steps", "save_steps",
                     "is_world_process_zero", "is_local_process_zero"):
            setattr(state, name, getattr(self.state, name))
        self.state = state
        self._pending_log_window = state.stateful_callbacks.pop("_log_window", None)
        self._last_saved_step = state.global_step
        extra = ckpt.load_extra_state(path)
        if extra is not None:
            self.load_extra_checkpoint_state(extra)

    def extra_checkpoint_state(self) -> dict | None:
        """This rank's extra state to keep in each checkpoint (tensors, numbers, strings in lists / dicts), e.g.
        GRPO's generation buffer; written inside the checkpoint's atomic save. None (the default) saves nothing."""
        return None

    def load_extra_checkpoint_state(self, state: dict) -> None:
        """Restore what ``extra_checkpoint_state`` returned, when resuming (after weights, optimizer, RNG and
        ``self.state`` are restored)."""

    def _enable_gradient_checkpointing(self) -> None:
        model = dist.unwrap_model(self.model)
        kwargs = {"use_reentrant": False}  # the non-reentrant form needs no input that requires grad
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2 name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        elif hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        else:
            raise ValueError(f"gradient_checkpointing=True needs a transformers model; {type(model).__name__} has "
                             f"no activation_checkpointing_enable() — wrap its blocks with "
                             f"torch.utils.checkpoint.checkpoint yourself")
        if hasattr(model, "config"):
            model.config.use_cache = False

    # ---- preemption ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _preemption_guard(self):
        """SIGTERM / Ctrl-C: finish the current optimizer step, save a checkpoint, end cleanly (see
        ``_act_on_control``). Handlers are installed only in the main thread and restored afterwards."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def request_stop(signum, frame):
            if self._stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C stops at once
            self._stop_signal = signum

        previous = {s: signal.signal(s, request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _exit_after_preemption(self) -> None:
        name = signal.Signals(self._stop_signal).name
        where = ckpt.latest_checkpoint(self.args.output_dir)
        if dist.is_main_process():
            print(f"treadle: stopped by {name} after step {self.state.global_step}; checkpoint: {where}. "
                  f"Resume with trainer.train(resume_from_checkpoint=True) (or `treadle train CONFIG --resume`).",
                  file=sys.stderr, flush=True)
        raise SystemExit(0)


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------
def _loss_of(outputs, inputs) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor) and outputs.dim() == 0:
        return outputs
    if isinstance(outputs, dict) or hasattr(outputs, "keys"):
        loss = outputs.get("loss") if hasattr(outputs, "get") else None
    elif isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor) and outputs[0].dim() == 0:
        loss = outputs[0]
    else:
        loss = getattr(outputs, "loss", None)
    if loss is None:
        keys = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
        raise ValueError(f"the model returned no loss (inputs: {keys}); pass labels (a 'labels' column) or "
                         f"override Trainer.compute_loss to compute it")
    return loss


def _logits_of(outputs, ignore_keys):
    if isinstance(outputs, torch.Tensor):
        return outputs
    ignore = {"loss", "past_key_values", "hidden_states", "attentions"} | set(ignore_keys or ())
    if hasattr(outputs, "items"):
        values = [v for k, v in outputs.items() if k not in ignore and isinstance(v, torch.Tensor)]
    else:
        values = [v for v in outputs if isinstance(v, torch.Tensor) and v.dim() > 0]
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _to_cpu(x):
    if isinstance(x, tuple):
        return x[0].detach().float().cpu() if x else None  # the first output (logits) for metrics
    return x.detach().cpu()


def _batch_rows(inputs) -> int:
    if isinstance(inputs, dict):
        for v in inputs.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                return v.shape[0]
            if isinstance(v, list):
                return len(v)
    return 1


def _gather_and_pad(tensors: list[torch.Tensor]):
    """Concatenate per-batch tensors (padding ragged sequence dims with -100) over all ranks, as numpy."""
    tensors = [t for part in dist.gather_objects(tensors) for t in part]
    if tensors[0].dim() <= 1 or all(t.shape[1:] == tensors[0].shape[1:] for t in tensors):
        out = torch.cat(tensors)
    else:
        length = max(t.shape[1] for t in tensors)
        padded = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, length - t.shape[1]), value=-100)
                  for t in tensors]
        out = torch.cat(padded)
    if out.dtype == torch.bfloat16:
        out = out.float()
    return out.numpy()


def _to_float(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return v
