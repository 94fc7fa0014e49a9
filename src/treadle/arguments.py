"""`TrainingArguments`: every knob of the training loop, each with a default and a one-line reason.

Names and meanings follow `transformers.TrainingArguments`, so a config written for it mostly carries over.
Invalid combinations fail in `__post_init__` with a message that says how to fix them.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from treadle.trackers import resolve_report_to

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
    report_to: str | list[str] = "none"  # trackers: wandb, mlflow, trackio, comet_ml, tensorboard, "all" or "none"
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

    # --- experiment trackers (report_to; treadle.trackers): transformers' names, read by its Trackio callback
    project: str = "huggingface"  # the Trackio project the run is logged in (W&B reads $WANDB_PROJECT)
    trackio_space_id: str | None = None  # a Hugging Face Space to log to live; None logs locally only
    trackio_bucket_id: str | None = None  # the Hugging Face Bucket behind that Space; None lets Trackio choose
    trackio_static_space_id: str | bool | None = None  # a read-only Space frozen after training; False: none
    hub_private_repo: bool | None = None  # Spaces Trackio creates are private; None: the account's default

    def __post_init__(self) -> None:
        self._validate_choices()
        self._validate_numbers()
        if self.eval_steps is None:
            self.eval_steps = self.logging_steps
        self.report_to = resolve_report_to(self.report_to)
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

    @classmethod
    def from_mapping(cls, mapping: dict[str, Any], *, other_keys: Iterable[str] = (),
                     context: str | None = None) -> "TrainingArguments":
        """The config that ``mapping`` describes (e.g. a YAML file read as a dict); ValueError when it cannot.

        A key that is not a field is refused, naming the closest of the fields and ``other_keys`` (keys the caller
        reads itself, never passed here). A value is converted to its field's type where YAML reads it otherwise
        (``1`` or ``"1e-3"`` for a float field, also inside lists); one of another type is refused, naming the key
        and the type its annotation wants. Each message is one line; an unknown key is "for" ``context`` (default:
        the class name; the CLI passes "trainer sft"). Subclasses inherit this and see their own fields.

        >>> TrainingArguments.from_mapping({"learning_rate": "1e-3", "warmup_steps": 2}).warmup_steps
        2.0
        """
        known = cls.field_names()
        for key in mapping:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known | set(other_keys)), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; see the fields of {cls.__name__}"
                raise ValueError(f"unknown key {key!r} for {context or cls.__name__}{hint}")
        # the real annotations: with `from __future__ import annotations` a field's .type is only a string
        hints = typing.get_type_hints(cls)
        return cls(**{key: _field_value(key, value, hints[key]) for key, value in mapping.items()})

    def replace(self, **changes) -> "TrainingArguments":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


# --- from_mapping's type rules ------------------------------------------------------------------------------
_WRONG = object()  # "this value does not fit this annotation" (None is a value that may fit)
_SCALARS = {float: ("a number", "numbers"), int: ("an integer", "integers"), bool: ("true or false", "booleans"),
            str: ("a string", "strings")}  # annotation -> (how a message names one, how it names several)


def _field_value(key: str, value: Any, annotation: Any) -> Any:
    """``value`` as the field ``key`` annotated ``annotation`` takes it; ValueError naming the key otherwise."""
    converted = _as_type(value, annotation)
    if converted is _WRONG:
        raise ValueError(f"{key} must be {_describe(annotation)}, got {value!r}")
    return converted


def _as_type(value: Any, annotation: Any) -> Any:
    """``value`` converted to ``annotation`` (float, int, bool, str, None, list[X] and unions of them), or _WRONG;
    ``value`` unchanged for any other annotation, which __post_init__ checks."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):  # X | Y: the first member that takes the value, in order
        return next((v for v in (_as_type(value, a) for a in args) if v is not _WRONG), _WRONG)
    if origin is list:
        if not isinstance(value, list):
            return _WRONG
        items = [_as_type(item, args[0]) for item in value] if args else list(value)
        return _WRONG if any(item is _WRONG for item in items) else items
    if annotation is type(None):
        return value if value is None else _WRONG
    if annotation is float:
        return _as_float(value)
    if annotation in _SCALARS:  # bool is an int to Python, never to a config
        fits = isinstance(value, annotation) and (annotation is bool or not isinstance(value, bool))
        return value if fits else _WRONG
    return value


def _as_float(value: Any) -> Any:
    # YAML reads `1` as an int and, in YAML 1.1, `1e-3` as a string; both are fine numbers for a float field
    if isinstance(value, bool) or not isinstance(value, (float, int, str)):
        return _WRONG
    try:
        return float(value)
    except ValueError:
        return _WRONG


def _describe(annotation: Any, plural: bool = False) -> str:
    """How an error message names what ``annotation`` takes: "an integer (or null)", "a list of strings"."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        text = " or ".join(_describe(a, plural) for a in members)
        return f"{text} (or null)" if len(members) < len(args) else text
    if origin is list:
        return ("lists of " if plural else "a list of ") + (_describe(args[0], plural=True) if args else "values")
    names = _SCALARS.get(annotation)
    return names[plural] if names else getattr(annotation, "__name__", str(annotation))


__all__ = ["TrainingArguments", "field"]


def check_config(args, config_class: type, trainer: str):
    """``args``, or ``config_class()`` when None; a config of another class is refused with the fix (every
    trainer names its config class; ``Trainer.check_args``)."""
    if args is None:
        return config_class()
    if not isinstance(args, config_class):
        name = config_class.__name__
        raise TypeError(f"{trainer} needs a {name}, got {type(args).__name__}; build one with "
                        f"{name}(**your_args.to_dict())")
    return args
