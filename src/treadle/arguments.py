"""`TrainingArguments`: every knob of the training loop, each with a default and a one-line reason.

Names and meanings follow `transformers.TrainingArguments`, so a config written for it mostly carries over.
Invalid combinations fail in `__post_init__` with a message that says how to fix them.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
import os
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from treadle import distributed
from treadle.optim import check_float16_adamw, check_scheduler_kwargs, optimizer_options

OPTIMIZERS = (
    "adamw",
    "adamw_torch",
    "adamw_torch_fused",
    "sgd",
    "adafactor",
    "adamw_8bit",
    "adamw_bnb_8bit",
    "paged_adamw_8bit",
    "adamw_torch_8bit",
    "adamw_torch_4bit",
)  # treadle.optim.build_optimizer
SCHEDULERS = (
    "constant",
    "constant_with_warmup",
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
)
TOKEN_COUNTS = ("no", "all", "non_padding")  # include_num_input_tokens_seen
STRATEGIES = ("no", "steps", "epoch")
MAX_LEARNING_RATE = 10.0  # far above any rate that trains; 1e300 overflowed inside torch


TRAINING_DTYPES = ("float32", "bfloat16", "float16")  # the weights' dtypes treadle trains in (model_init_kwargs)


def check_model_dtype(kwargs: dict | None, name: str, args=None) -> None:
    """Refuse (ValueError, one line) a ``dtype`` (or transformers' older ``torch_dtype``) among a model's
    ``from_pretrained`` keywords that treadle does not train in (``TRAINING_DTYPES`` as names or torch dtypes, and
    ``"auto"``: the checkpoint's own), and float16 weights that ``args``' AdamW cannot train
    (``optim.check_float16_adamw``)."""
    for key in ("dtype", "torch_dtype"):
        value = kwargs.get(key) if isinstance(kwargs, dict) else None
        spelled = str(value).removeprefix("torch.") if value is not None else None
        if value is None or spelled == "auto" and isinstance(value, str):
            continue
        if spelled not in TRAINING_DTYPES:
            raise ValueError(
                f"{name}: {key}={spelled!r} is not a dtype treadle trains weights in; use one of "
                f"{', '.join(TRAINING_DTYPES)} or auto (the checkpoint's own)"
            )
        if spelled == "float16" and args is not None:
            check_float16_adamw(args, f"{name}: {key}=float16")


def expand_path(path):
    """``~`` and ``$VARS`` expanded in a path setting (a YAML or Python value), as a shell would."""
    return os.path.expandvars(os.path.expanduser(path)) if isinstance(path, str) else path


FSDP_MODES = ("", "full_shard")


@dataclass
class TrainingArguments:
    # --- where things go
    output_dir: str = "trainer_output"  # checkpoints, metrics.jsonl and plots land here
    run_name: str | None = None  # a label for loggers (TensorBoard); defaults to output_dir's name
    overwrite_output_dir: bool = False  # a new run may delete an earlier run's files in output_dir (record/runs.py)
    ignore_checkpoint_fingerprints: bool = False  # resume even when a checkpoint's files differ from its marker

    # --- how long
    num_train_epochs: float = 3.0  # passes over the training set; fractional values stop mid-epoch
    max_steps: int = -1  # optimizer steps; > 0 overrides num_train_epochs

    # --- batch
    per_device_train_batch_size: int = 8  # rows per micro-batch on each process
    per_device_eval_batch_size: int = 8  # rows per evaluation batch on each process
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step (exact: see Trainer.compute_loss)

    # --- optimizer
    optim: str = "adamw"  # "adamw" (= "adamw_torch"), "adamw_torch_fused", "sgd", "adafactor", "adamw_8bit"...
    learning_rate: float = 5e-5  # peak learning rate, reached after warm-up
    weight_decay: float = 0.0  # decoupled weight decay, applied to matrices only (not biases / norms)
    adam_beta1: float = 0.9  # AdamW first-moment decay
    adam_beta2: float = 0.999  # AdamW second-moment decay
    adam_epsilon: float = 1e-8  # AdamW denominator guard
    max_grad_norm: float = 1.0  # clip the global gradient norm to this; 0 disables clipping
    skip_nonfinite_steps: int = 0  # steps whose loss is NaN/inf that may be skipped (not applied) before stopping

    # --- schedule
    lr_scheduler_type: str = "linear"  # transformers' names: "linear", "cosine", "constant_with_warmup"... SCHEDULERS
    warmup_steps: float = 0  # steps of linear warm-up from 0; a float in (0, 1) is a fraction of all steps

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
    torch_compile: bool = False  # compile each transformer block (torch.compile) before training; docs/performance.md
    torch_compile_backend: str | None = None  # torch.compile's backend; setting it sets torch_compile ("inductor")
    torch_compile_mode: str | None = None  # torch.compile's mode ("reduce-overhead", ...); sets torch_compile
    keep_freed_memory: bool = True  # on CPU, train() has glibc keep freed memory during the run (treadle.allocator)

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
    ddp_timeout: float | None = None  # seconds a collective waits for other ranks; None: $TREADLE_DDP_TIMEOUT or 1800

    # --- experiment trackers (report_to; treadle.trackers): transformers' names, read by its Trackio callback
    project: str = "huggingface"  # the Trackio project the run is logged in (W&B reads $WANDB_PROJECT)
    trackio_space_id: str | None = None  # a Hugging Face Space to log to live; None logs locally only
    trackio_bucket_id: str | None = None  # the Hugging Face Bucket behind that Space; None lets Trackio choose
    trackio_static_space_id: str | bool | None = None  # a read-only Space frozen after training; False: none
    hub_private_repo: bool | None = None  # Spaces Trackio creates are private; None: the account's default

    # --- PEFT / LoRA (a trainer's peft_config; docs/peft.md)
    merge_adapters: bool = False  # save_model also writes the adapters merged into the base, in output_dir/merged

    # --- a model named by a string (TRL's names, in every TRL trainer config; treadle.models.load_pretrained)
    model_init_kwargs: dict[str, Any] | None = None  # from_pretrained keywords: {"revision": "v1", "dtype": "float32"}
    trust_remote_code: bool = False  # run Python code shipped with a Hub model or tokenizer; only when you trust it

    # --- more of transformers' names, same meaning (docs/coming-from-transformers-and-trl.md)
    lr_scheduler_kwargs: dict[str, Any] | None = None  # schedule options, e.g. {"min_lr_rate": 0.1}; see optim.py
    optim_args: str | None = None  # "momentum=0.9,nesterov=True": SGD's (no momentum without it); optim.OPTIM_ARGS
    eval_on_start: bool = False  # evaluate once before the first step (checks the evaluation set-up early)
    eval_delay: float = 0  # no evaluation before this many steps (epochs when eval_strategy="epoch")
    include_num_input_tokens_seen: str | bool = "no"  # "all", "non_padding" (True = "all"): log num_input_tokens_seen
    gradient_checkpointing_kwargs: dict[str, Any] | None = None  # for checkpoint(); default {"use_reentrant": False}

    def __new__(cls, *args, **kwargs):
        # a transformers field treadle does not have: say what to do instead (the generated __init__ would only
        # say "unexpected keyword argument")
        refused = sorted(set(kwargs) & set(NOT_SUPPORTED))
        if refused:
            raise ValueError(f"{refused[0]} is not supported by treadle: {NOT_SUPPORTED[refused[0]]}")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        _validate_types(self)
        self.output_dir = expand_path(self.output_dir)
        self._validate_transformers_names()
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

    def _validate_transformers_names(self) -> None:
        if isinstance(self.include_num_input_tokens_seen, bool):  # transformers' bool form
            self.include_num_input_tokens_seen = "all" if self.include_num_input_tokens_seen else "no"
        if self.include_num_input_tokens_seen not in TOKEN_COUNTS:
            raise ValueError(
                f"include_num_input_tokens_seen={self.include_num_input_tokens_seen!r} is not supported; "
                f"use one of {list(TOKEN_COUNTS)} (or True / False)"
            )
        if self.eval_delay < 0:
            raise ValueError(f"eval_delay must be >= 0, got {self.eval_delay}")
        for name in ("lr_scheduler_kwargs", "gradient_checkpointing_kwargs", "model_init_kwargs"):
            value = getattr(self, name)
            if isinstance(value, str):  # transformers accepts JSON text, as a command line gives it
                setattr(self, name, value := json.loads(value))
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"{name} must be a mapping (e.g. {{}}), got {value!r}")
        check_model_dtype(self.model_init_kwargs, "model_init_kwargs", self)
        check_scheduler_kwargs(self.lr_scheduler_type, self.lr_scheduler_kwargs)  # names a pointer for the refused
        if self.torch_compile_backend is not None or self.torch_compile_mode is not None:
            self.torch_compile = True  # as transformers: either setting asks for compilation
        if self.torch_compile and self.torch_compile_backend is None:
            self.torch_compile_backend = "inductor"
        optimizer_options(self.optim, self.optim_args)

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
        for name in (
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "gradient_accumulation_steps",
            "logging_steps",
            "save_steps",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.eval_steps is not None and (not isinstance(self.eval_steps, int) or self.eval_steps < 1):
            raise ValueError(
                f"eval_steps must be an integer >= 1 (or None for logging_steps), got {self.eval_steps!r}"
            )
        if self.skip_nonfinite_steps < 0:
            raise ValueError(f"skip_nonfinite_steps must be >= 0, got {self.skip_nonfinite_steps}")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            raise ValueError("nothing to train: set max_steps > 0 or num_train_epochs > 0")
        if not 0 <= self.learning_rate <= MAX_LEARNING_RATE:
            raise ValueError(
                f"learning_rate must lie in [0, {MAX_LEARNING_RATE:g}] (typical: 1e-6 .. 1e-2), "
                f"got {self.learning_rate:g}"
            )
        if not 0 <= self.seed < 2**32 or (self.data_seed is not None and not 0 <= self.data_seed < 2**32):
            raise ValueError(
                f"seed and data_seed must lie in [0, 2**32 - 1] (numpy's range), got "
                f"seed={self.seed}, data_seed={self.data_seed}"
            )
        if self.dataloader_num_workers < 0:
            raise ValueError(
                f"dataloader_num_workers must be >= 0 (0 loads in the main process), got {self.dataloader_num_workers}"
            )
        if self.warmup_steps < 0 or (self.warmup_steps >= 1 and self.warmup_steps != int(self.warmup_steps)):
            raise ValueError(
                f"warmup_steps must be a whole number of steps or a fraction in [0, 1), got {self.warmup_steps}"
            )
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
                raise ValueError(
                    f"load_best_model_at_end needs save_strategy == eval_strategy, got "
                    f"save_strategy={self.save_strategy!r} and eval_strategy={self.eval_strategy!r}"
                )
            if self.save_strategy == "steps" and self.save_steps % self.eval_steps:
                raise ValueError(
                    f"load_best_model_at_end needs save_steps to be a multiple of eval_steps, got "
                    f"save_steps={self.save_steps} and eval_steps={self.eval_steps}; e.g. set "
                    f"save_steps={self.eval_steps * max(1, round(self.save_steps / self.eval_steps))}"
                )
            if self.metric_for_best_model is None:
                self.metric_for_best_model = "loss"
        if self.metric_for_best_model is not None and self.greater_is_better is None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")

    # --- derived values -------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Number of processes (torchrun's WORLD_SIZE, 1 without torchrun)."""
        return distributed.launched("WORLD_SIZE")

    @property
    def process_index(self) -> int:
        """This process's global rank (torchrun's RANK, 0 without torchrun)."""
        return distributed.launched("RANK")

    @property
    def local_process_index(self) -> int:
        """This process's rank on its machine (torchrun's LOCAL_RANK)."""
        return distributed.launched("LOCAL_RANK")

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
    def from_mapping(
        cls, mapping: dict[str, Any], *, other_keys: Iterable[str] = (), context: str | None = None
    ) -> TrainingArguments:
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
            if key in NOT_SUPPORTED and key not in known:
                raise ValueError(f"{key} is not supported by treadle: {NOT_SUPPORTED[key]}")
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known | set(other_keys)), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; see the fields of {cls.__name__}"
                raise ValueError(f"unknown key {key!r} for {context or cls.__name__}{hint}")
        # the real annotations: with `from __future__ import annotations` a field's .type is only a string
        hints = typing.get_type_hints(cls)
        return cls(**{key: _field_value(key, value, hints[key]) for key, value in mapping.items()})

    def replace(self, **changes) -> TrainingArguments:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


# --- the log-prob forwards' options (treadle.logprobs; TRL's names): each declared once, mixed into the configs of
# the trainers that take it, before TrainingArguments: class KTOConfig(LogprobChunkOption, ..., TrainingArguments)
@dataclass
class PaddingFreeOption:
    """``padding_free``: DPO, KTO, GRPO."""

    padding_free: bool = True  # pack each micro-batch's rows without padding for the log-prob forwards (exact)


@dataclass
class SharedPrefixOption:
    """``shared_prefix``: DPO (a pair's prompt, then chosen and rejected), GRPO (a group's prompt, then its
    completions)."""

    shared_prefix: bool = True  # each prompt once per micro-batch, its completions after it (exact; off where unfit)


@dataclass
class LogprobChunkOption:
    """``logprob_chunk_size``: DPO, KTO (``logprobs.token_logps``), distillation (through both LM heads,
    ``losses.chunked_generalized_jsd``)."""

    # None: 1,024 rows, fewer beyond a 49k vocabulary (192 at 262k): at most 50,331,648 logits (logprobs.chunk_rows)
    logprob_chunk_size: int | None = None  # positions per chunk through the LM head: fewer hold fewer logits (192 MiB)

    def __post_init__(self) -> None:
        super().__post_init__()  # the TrainingArguments this is mixed into: its checks (and types) first
        if self.logprob_chunk_size is not None and self.logprob_chunk_size < 1:
            raise ValueError(
                f"logprob_chunk_size must be >= 1 or None (the vocabulary's default), got {self.logprob_chunk_size}"
            )


# --- from_mapping's type rules ------------------------------------------------------------------------------
_WRONG = object()  # "this value does not fit this annotation" (None is a value that may fit)
_SCALARS = {
    float: ("a number", "numbers"),
    int: ("an integer", "integers"),
    bool: ("true or false", "booleans"),
    str: ("a string", "strings"),
}  # annotation -> (how a message names one, how it names several)


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


# transformers fields that treadle refuses, with what to do instead (TrainingArguments.__new__, from_mapping)
NOT_SUPPORTED = {
    "fp16": "use bf16=True (bfloat16 autocast needs no loss scaling)",
    "fp16_full_eval": "use bf16=True (evaluation runs under the same autocast as training)",
    "bf16_full_eval": "bf16=True already evaluates under bfloat16 autocast",
    "tf32": "set torch.backends.cuda.matmul.allow_tf32 = True before training",
    "activation_checkpointing": "use gradient_checkpointing=True (transformers 5's older name, same behaviour)",
    "activation_checkpointing_kwargs": "use gradient_checkpointing_kwargs",
    "eval_accumulation_steps": "not needed: evaluation moves predictions to the CPU after every batch",
    "neftune_noise_alpha": "NEFTune is not built in; add noise to the input embeddings in a forward hook",
    "group_by_length": "length-grouped sampling is not built in; override Trainer.build_sampler",
    "train_sampling_strategy": "treadle shuffles with a seeded sampler; override Trainer.build_sampler for another",
    "label_smoothing_factor": "override Trainer.compute_loss with a smoothed cross-entropy",
    "torch_empty_cache_steps": "call torch.cuda.empty_cache() from a callback's on_step_end",
    "auto_find_batch_size": "set per_device_train_batch_size and gradient_accumulation_steps yourself",
    "deepspeed": "use fsdp='full_shard' (FSDP2) for sharded training",
    "fsdp_config": "fsdp='full_shard' needs no config",
    "push_to_hub": "call model.push_to_hub(...) after training",
    "use_liger_kernel": "not built in",
    "logging_nan_inf_filter": "treadle logs the loss as it is (a NaN is shown, not hidden)",
    "resume_from_checkpoint": "pass it to train(resume_from_checkpoint=...) (or `treadle train --resume`)",
    "do_train": "not needed: call train() / evaluate() / predict()",
    "do_eval": "not needed: set eval_strategy, or call evaluate()",
    "do_predict": "not needed: call predict()",
    "use_cpu": "treadle uses the GPU when there is one; hide it with CUDA_VISIBLE_DEVICES=''",
    "optim_target_modules": "GaLore / APOLLO optimizers are not built in",
}

__all__ = ["TrainingArguments", "PaddingFreeOption", "SharedPrefixOption", "LogprobChunkOption", "field"]

FINITE_FIELDS = ("learning_rate", "num_train_epochs", "weight_decay", "adam_epsilon", "warmup_steps")  # inf refused


def _validate_types(config) -> None:
    """Every field of ``config`` (any subclass) as its annotation wants it, with from_mapping's rules (so a
    number given as a string is read as one); ValueError naming the field otherwise. NaN is refused in every
    number field, an infinity in ``FINITE_FIELDS``: a loop would train on it without a word."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        if f.name not in hints:
            continue
        value = _field_value(f.name, getattr(config, f.name), hints[f.name])
        if isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and f.name in FINITE_FIELDS)):
            raise ValueError(f"{f.name} must be a finite number, got {value}")
        setattr(config, f.name, value)


def check_config(args, config_class: type, trainer: str):
    """``args``, or ``config_class()`` when None; a config of another class is refused with the fix (every
    trainer names its config class; ``Trainer.check_args``)."""
    if args is None:
        return config_class()
    if not isinstance(args, config_class):
        name = config_class.__name__
        raise TypeError(
            f"{trainer} needs a {name}, got {type(args).__name__}; build one with {name}(**your_args.to_dict())"
        )
    return args


# ---------------------------------------------------------------------------------------------------------
# report_to: the trackers treadle knows (treadle.trackers builds their callbacks)
# ---------------------------------------------------------------------------------------------------------
# report_to name -> (module that must import, pip package, transformers callback); the order "all" lists them in
TRACKERS = {
    "wandb": ("wandb", "wandb", "WandbCallback"),
    "mlflow": ("mlflow", "mlflow-skinny", "MLflowCallback"),
    "trackio": ("trackio", "trackio", "TrackioCallback"),
    "comet_ml": ("comet_ml", "comet_ml", "CometCallback"),
    "tensorboard": ("tensorboard", "tensorboard", "TensorBoardCallback"),
}


def resolve_report_to(report_to) -> list[str]:
    """``report_to`` as a list of tracker names, as transformers reads it: a name or a list of names; ``"all"``:
    every installed tracker; ``"none"`` (or None, ``""``, ``[]``): none. ValueError naming the valid names.

    >>> resolve_report_to("none"), resolve_report_to(["wandb", "mlflow"])
    ([], ['wandb', 'mlflow'])
    """
    names = [report_to] if isinstance(report_to, str) else report_to
    if names is None or names in ([], [""], ["none"]):
        return []
    if names == ["all"]:
        return [name for name in TRACKERS if is_installed(name)]
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"report_to must be a tracker name or a list of them, got {report_to!r}")
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(
            f"report_to={report_to!r}: {', '.join(map(repr, unknown))} is not a tracker treadle "
            f"supports; use some of {sorted(TRACKERS)}, or 'all' / 'none'"
        )
    return list(dict.fromkeys(names))  # each tracker once, in the order given


def is_installed(name: str) -> bool:
    """Whether tracker ``name``'s library can be imported (without importing it)."""
    return importlib.util.find_spec(TRACKERS[name][0]) is not None
