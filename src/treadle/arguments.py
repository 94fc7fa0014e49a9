"""`TrainingArguments`: every knob of the training loop, each with a default and a one-line reason.

Names and meanings follow `transformers.TrainingArguments`, so a config written for it mostly carries over.
Invalid combinations fail in `__post_init__` with a message that says how to fix them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

OPTIMIZERS = ("adamw", "adamw_torch", "adamw_torch_fused", "sgd")
SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
STRATEGIES = ("no", "steps", "epoch")
FSDP_MODES = ("", "full_shard")


@dataclass
class TrainingArguments:
    # --- where things go
    output_dir: str = "trainer_output"  # checkpoints, metrics.jsonl and plots land here
    run_name: str | None = None  # a label for loggers (TensorBoard); defaults to output_dir's name

    # --- how long
    num_train_epochs: float = 3.0  # passes over the training set; fractional values stop mid-epoch
    max_steps: int = -1  # optimizer steps; > 0 overrides num_train_epochs

    # --- batch
    per_device_train_batch_size: int = 8  # rows per micro-batch on each process
    per_device_eval_batch_size: int = 8  # rows per evaluation batch on each process
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step (exact: see Trainer.compute_loss)

    # --- optimizer
    optim: str = "adamw"  # "adamw" (torch AdamW), "adamw_torch_fused" or "sgd"
    learning_rate: float = 5e-5  # peak learning rate, reached after warm-up
    weight_decay: float = 0.0  # decoupled weight decay, applied to matrices only (not biases / norms)
    adam_beta1: float = 0.9  # AdamW first-moment decay
    adam_beta2: float = 0.999  # AdamW second-moment decay
    adam_epsilon: float = 1e-8  # AdamW denominator guard
    max_grad_norm: float = 1.0  # clip the global gradient norm to this; 0 disables clipping

    # --- schedule
    lr_scheduler_type: str = "linear"  # "constant", "constant_with_warmup", "linear" or "cosine"
    warmup_steps: float = 0  # steps of linear warm-up; a float in (0, 1) is a fraction of all steps

    # --- logging, evaluation, saving (cadence lives in treadle.callbacks.FlowCallback)
    logging_strategy: str = "steps"  # "no", "steps" or "epoch"
    logging_steps: int = 10  # log every N optimizer steps
    logging_first_step: bool = False  # also log after the very first step
    eval_strategy: str = "no"  # "no", "steps" or "epoch"
    eval_steps: int | None = None  # evaluate every N steps; defaults to logging_steps
    save_strategy: str = "steps"  # "no", "steps" or "epoch"
    save_steps: int = 500  # checkpoint every N optimizer steps
    save_total_limit: int | None = None  # keep at most N checkpoints (never the best nor the newest)
    save_only_model: bool = False  # checkpoints hold weights only: smaller, but not resumable
    load_best_model_at_end: bool = False  # reload the best checkpoint's weights when training ends
    metric_for_best_model: str | None = None  # e.g. "loss" or "eval_accuracy"; default "loss" when needed
    greater_is_better: bool | None = None  # direction of metric_for_best_model; default: False for losses
    report_to: str | list[str] = "none"  # extra loggers: "tensorboard", "all" or "none" (metrics.jsonl is always on)
    disable_tqdm: bool = False  # print logs as lines instead of progress bars
    prediction_loss_only: bool = False  # evaluate() skips gathering logits and labels

    # --- reproducibility
    seed: int = 42  # seeds python, numpy and torch before the model is trained
    data_seed: int | None = None  # seeds the data order; defaults to seed

    # --- precision and memory
    bf16: bool = False  # run forwards under bfloat16 autocast (CPU and GPU); weights stay float32
    gradient_checkpointing: bool = False  # recompute activations in backward (transformers models)

    # --- data
    remove_unused_columns: bool = True  # drop dataset columns that the model's forward does not take
    label_names: list[str] | None = None  # input keys holding labels; default ["labels"]
    dataloader_num_workers: int = 0  # worker processes for loading; 0 loads in the main process
    dataloader_drop_last: bool = False  # drop the last incomplete batch of each epoch
    dataloader_pin_memory: bool = True  # pin host memory for faster copies to a GPU (ignored on CPU)

    # --- distributed (torchrun); see treadle.distributed
    fsdp: str = ""  # "" for DDP when world size > 1, "full_shard" for FSDP2 (fully_shard)
    ddp_find_unused_parameters: bool = False  # set True when some parameters get no gradient in a step
    average_tokens_across_devices: bool = True  # normalise the loss by items summed over all ranks
    ddp_timeout: float | None = None  # seconds a collective waits for the other ranks; None: $TREADLE_DDP_TIMEOUT or 1800

    def __post_init__(self) -> None:
        self._validate_choices()
        self._validate_numbers()
        if self.eval_steps is None:
            self.eval_steps = self.logging_steps
        if isinstance(self.report_to, str):
            self.report_to = [] if self.report_to in ("none", "") else [self.report_to]
        if self.label_names is None:
            self.label_names = ["labels"]
        if self.data_seed is None:
            self.data_seed = self.seed
        self._validate_best_model()

    def _validate_choices(self) -> None:
        for name, value, allowed in (
            ("optim", self.optim, OPTIMIZERS),
            ("lr_scheduler_type", self.lr_scheduler_type, SCHEDULERS),
            ("logging_strategy", self.logging_strategy, STRATEGIES),
            ("eval_strategy", self.eval_strategy, STRATEGIES),
            ("save_strategy", self.save_strategy, STRATEGIES),
            ("fsdp", self.fsdp, FSDP_MODES),
        ):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not supported; use one of {list(allowed)}")

    def _validate_numbers(self) -> None:
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                     "logging_steps", "save_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.eval_steps is not None and (not isinstance(self.eval_steps, int) or self.eval_steps < 1):
            raise ValueError(f"eval_steps must be an integer >= 1 (or None for logging_steps), got {self.eval_steps!r}")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            raise ValueError("nothing to train: set max_steps > 0 or num_train_epochs > 0")
        if self.learning_rate < 0:
            raise ValueError(f"learning_rate must be >= 0, got {self.learning_rate}")
        if self.warmup_steps < 0 or (self.warmup_steps >= 1 and self.warmup_steps != int(self.warmup_steps)):
            raise ValueError(f"warmup_steps must be a whole number of steps or a fraction in [0, 1), "
                             f"got {self.warmup_steps}")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0 disables clipping), got {self.max_grad_norm}")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise ValueError(f"save_total_limit must be >= 1 or None, got {self.save_total_limit}")
        if not 0.0 <= self.adam_beta1 < 1.0 or not 0.0 <= self.adam_beta2 < 1.0:
            raise ValueError("adam_beta1 and adam_beta2 must lie in [0, 1)")

    def _validate_best_model(self) -> None:
        if self.load_best_model_at_end:
            if self.eval_strategy == "no":
                raise ValueError("load_best_model_at_end needs evaluations: set eval_strategy='steps' or 'epoch'")
            if self.save_strategy != self.eval_strategy:
                raise ValueError(f"load_best_model_at_end needs save_strategy == eval_strategy, got "
                                 f"save_strategy={self.save_strategy!r} and eval_strategy={self.eval_strategy!r}")
            if self.save_strategy == "steps" and self.save_steps % self.eval_steps:
                raise ValueError(f"load_best_model_at_end needs save_steps to be a multiple of eval_steps, got "
                                 f"save_steps={self.save_steps} and eval_steps={self.eval_steps}; e.g. set "
                                 f"save_steps={self.eval_steps * max(1, round(self.save_steps / self.eval_steps))}")
            if self.metric_for_best_model is None:
                self.metric_for_best_model = "loss"
        if self.metric_for_best_model is not None and self.greater_is_better is None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")

    # --- derived values -------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Number of processes (torchrun's WORLD_SIZE, 1 without torchrun)."""
        return int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def process_index(self) -> int:
        """This process's global rank (torchrun's RANK, 0 without torchrun)."""
        return int(os.environ.get("RANK", "0"))

    @property
    def local_process_index(self) -> int:
        """This process's rank on its machine (torchrun's LOCAL_RANK)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def train_batch_size(self) -> int:
        """Rows per micro-batch on one process."""
        return self.per_device_train_batch_size

    @property
    def device(self):
        import torch

        if torch.cuda.is_available():
            return torch.device("cuda", self.local_process_index)
        return torch.device("cpu")

    def num_warmup_steps(self, num_training_steps: int) -> int:
        """Warm-up length in steps: `warmup_steps` itself, or that fraction of the run when it is below 1."""
        if 0 < self.warmup_steps < 1:
            return math.ceil(self.warmup_steps * num_training_steps)
        return int(self.warmup_steps)

    # --- serialisation --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def replace(self, **changes) -> "TrainingArguments":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


__all__ = ["TrainingArguments", "field"]
