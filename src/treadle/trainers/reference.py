"""Precomputed reference log-probs: the one pass that adds a preference trainer's reference columns to its
datasets (``precompute_ref_log_probs``), shared by DPO and KTO.

A trainer mixes in ``PrecomputedReference`` before ``Trainer`` and gives ``reference_columns()`` (the column
names, in order, of what its ``reference_logps(inputs)`` returns: a tuple of ``(B,)`` tensors, one per name)
and ``prepare_dataset(dataset, split)``. Before training the train and eval datasets gain the columns and the
reference copy is freed (a PEFT policy stays: with its adapters off it is its own reference); an eval dataset
given to ``evaluate()`` later gains them in the same pass.
"""

from __future__ import annotations

import gc

import torch

from treadle import distributed as dist
from treadle.console import show_progress_bars
from treadle.data import column_names
from treadle.models import eval_mode
from treadle.streaming import require_streamable


class PrecomputedReference:
    """``prepare_training`` / ``get_eval_dataloader`` for a trainer whose loss reads reference log-prob columns."""

    def reference_columns(self) -> tuple[str, ...]:
        raise NotImplementedError

    def prepare_training(self) -> None:
        if self.args.precompute_ref_log_probs:
            self.precompute_reference_logps()

    def get_eval_dataloader(self, eval_dataset=None):
        if eval_dataset is not None:
            eval_dataset = self.prepare_dataset(eval_dataset, "eval")
        if self.args.precompute_ref_log_probs:
            if eval_dataset is not None:
                eval_dataset = self.add_reference_logps(eval_dataset, "eval")
            elif self.eval_dataset is not None:
                self.eval_dataset = self.add_reference_logps(self.eval_dataset, "eval")
        return super().get_eval_dataloader(eval_dataset)

    def precompute_reference_logps(self) -> None:
        """Add reference log-prob columns to the training and evaluation datasets, then free the reference
        model (a PEFT policy stays: it is its own reference)."""
        if self.train_dataset is not None:
            self.train_dataset = self.add_reference_logps(self.train_dataset, "train")
        if self.eval_dataset is not None:
            self.eval_dataset = self.add_reference_logps(self.eval_dataset, "eval")
        if self.ref_model is not None:
            self.free_reference_model()

    def free_reference_model(self) -> None:
        """Drop the reference model (after ``precompute_ref_log_probs`` has used it)."""
        self.ref_model = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def add_reference_logps(self, dataset, split: str):
        """``dataset`` with the ``reference_columns()`` (one pass in eval mode, a progress bar); a dataset that
        holds them all is returned as it is, one holding some gets them all recomputed."""
        from tqdm.auto import tqdm  # as the progress callback: only a run that precomputes pays for it

        columns = self.reference_columns()
        if all(c in (column_names(dataset) or []) for c in columns):
            return dataset
        require_streamable(dataset, "precompute_ref_log_probs")  # one pass that adds columns: not over a stream
        loader = self.build_dataloader(dataset, batch_size=self.args.per_device_eval_batch_size)
        values: dict[str, list[float]] = {c: [] for c in columns}
        with eval_mode(dist.unwrap_model(self.model)):  # a PEFT policy is the reference here: no dropout
            for inputs in tqdm(
                loader,
                desc=f"Reference log-probs ({split})",
                dynamic_ncols=True,
                disable=not show_progress_bars(self.args) or not dist.is_main_process(),
            ):
                with self.autocast():
                    scores = self.reference_logps(self.prepare_inputs(inputs))
                for column, score in zip(columns, scores):
                    values[column] += score.tolist()
        dataset = dataset.remove_columns([c for c in columns if c in dataset.column_names])
        for column in columns:
            dataset = dataset.add_column(column, values[column])
        return dataset
