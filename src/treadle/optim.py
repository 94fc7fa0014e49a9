"""Optimizer and learning-rate schedule builders: transformers' names mean transformers' behaviour.

Every ``optim`` and ``lr_scheduler_type`` name that treadle shares with ``transformers.TrainingArguments`` builds the
same optimizer and the same multiplier of the peak learning rate at every step (tests/test_parity_transformers.py
checks each against transformers itself). The schedules are transformers' own (``get_scheduler``): treadle adds only
the check that every ``lr_scheduler_kwargs`` option is one the schedule reads. Step ``s`` counts optimizer steps
already taken: the first update uses ``s = 0``, which is why a warm-up starts at 0 (as in transformers) and reaches the
peak at ``s = warmup``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging

import torch
from packaging.version import Version  # transformers' own dependency
from torch.optim.lr_scheduler import LambdaLR

# names transformers has that treadle refuses, with what to do instead
_SCHEDULER_POINTERS = {
    "reduce_lr_on_plateau": "it steps on an evaluation metric; pass your own scheduler with "
    "optimizers=(optimizer, torch.optim.lr_scheduler.ReduceLROnPlateau(...)) and step it "
    "from a callback's on_evaluate",
    "greedy": "pass your own scheduler with Trainer(optimizers=(optimizer, scheduler))",
}


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices decay, vectors (biases, norm weights) and scalars don't — as in nanoGPT and GPT-2.
    (transformers decides by name: no decay for biases and LayerNorm / RMSNorm weights; the same split for
    every transformers model, docs/coming-from-transformers-and-trl.md.)"""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def parse_optim_args(text: str | None) -> dict[str, str]:
    """transformers' ``optim_args`` format: ``"momentum=0.9, nesterov=True"`` -> ``{"momentum": "0.9", ...}``.

    >>> parse_optim_args("momentum=0.9, nesterov=True")
    {'momentum': '0.9', 'nesterov': 'True'}
    """
    if not text:
        return {}
    out = {}
    for item in text.replace(" ", "").split(","):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"optim_args must read 'key=value,key=value' (e.g. 'momentum=0.9'), got {text!r}")
        out[key] = value
    return out


TORCHAO_ADAMW = {"adamw_torch_8bit": "AdamW8bit", "adamw_torch_4bit": "AdamW4bit"}  # optim -> torchao.optim class
OPTIM_ARGS = {  # the optim_args keys each optimizer reads (transformers' names), and how each value is read
    "sgd": {"momentum": float, "dampening": float, "weight_decay": float, "nesterov": "bool"},
    **dict.fromkeys(TORCHAO_ADAMW, {"block_size": int, "bf16_stochastic_round": "bool"}),
}


def optimizer_options(optim: str, optim_args: str | None) -> dict:
    """The keyword arguments ``optim_args`` gives the optimizer ``optim`` (``OPTIM_ARGS``): SGD's ``momentum``,
    ``dampening``, ``weight_decay`` and ``nesterov``; torchao's 8-bit and 4-bit AdamW's ``block_size`` and
    ``bf16_stochastic_round`` (transformers reads those); other optimizers take none.

    >>> optimizer_options("sgd", "momentum=0.9,nesterov=True")
    {'momentum': 0.9, 'nesterov': True}
    >>> optimizer_options("adamw_torch_8bit", "block_size=128")
    {'block_size': 128}
    """
    options = parse_optim_args(optim_args)
    readers = OPTIM_ARGS.get(optim, {})
    if options and not readers:
        raise ValueError(
            f"optim_args is read by optim={' / '.join(repr(name) for name in OPTIM_ARGS)} only; "
            f"optim={optim!r} takes its settings from adam_beta1, adam_beta2, adam_epsilon"
        )
    kwargs: dict = {}
    for key, value in options.items():
        if key not in readers:
            raise ValueError(f"optim_args key {key!r} is not a setting of optim={optim!r}; use {', '.join(readers)}")
        read = readers[key]
        try:
            kwargs[key] = value.lower() in ("true", "1", "yes") if read == "bool" else read(value)
        except ValueError:
            example = "128" if read is int else "0.9"
            raise ValueError(f"optim_args {key}={value!r} is not a number; e.g. {key}={example}") from None
    return kwargs


def _bitsandbytes_adamw(groups: list[dict], args, paged: bool) -> torch.optim.Optimizer:
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError(
            f"optim={args.optim!r} needs bitsandbytes (8-bit optimizer states, CUDA): "
            f"pip install bitsandbytes; or use optim='adamw_torch'"
        )
    from bitsandbytes.optim import AdamW

    return AdamW(
        groups,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        optim_bits=8,
        is_paged=paged,
    )


ADAMW_OPTIMIZERS = ("adamw", "adamw_torch", "adamw_torch_fused")  # torch's AdamW: its state in the weights' dtype
FLOAT16_TINY = 2.0**-25  # half float16's smallest positive number: anything smaller rounds to 0 in float16


def check_float16_adamw(args, weights: str) -> None:
    """Refuse (ValueError, one line) float16 weights (``weights`` says where from) trained by torch's AdamW with an
    ``adam_epsilon`` that is 0 in float16 (the default 1e-8 is): the update divides by zero wherever a squared
    gradient underflows, and the loss becomes nan at any learning rate (refused, not warned: no run trains so)."""
    if args.optim in ADAMW_OPTIMIZERS and args.adam_epsilon < FLOAT16_TINY:
        raise ValueError(
            f"{weights} with optim={args.optim} and adam_epsilon={args.adam_epsilon:g}: the epsilon is 0 in float16, "
            f"so AdamW divides by zero and the loss becomes nan at any learning rate; train float32 weights (bf16: "
            f"true for speed), bfloat16 weights, or raise adam_epsilon (e.g. 1e-4)"
        )


TORCHAO_MIN_VERSION = "0.15.0"  # transformers' own floor for these names (transformers.utils.import_utils)


def _torchao_adamw(groups: list[dict], args, options: dict) -> torch.optim.Optimizer:
    """torchao's ``AdamW8bit`` / ``AdamW4bit``, as transformers builds them: its betas and epsilon, ``block_size``
    256 and ``bf16_stochastic_round`` False unless ``optim_args`` says. torchao quantizes the two moments of every
    tensor of at least 4,096 values (a multiple of ``block_size``) in blocks; smaller tensors (norm weights, biases)
    keep float32 moments. Its step is ``torch.compile``d once per parameter shape (the first step pays for it)."""
    if importlib.util.find_spec("torchao") is None:
        raise ImportError(
            f"optim={args.optim!r} needs torchao (8-bit / 4-bit AdamW states, on CPU and GPU): "
            f"pip install torchao; or use optim='adamw_torch'"
        )
    found = importlib.metadata.version("torchao")
    if Version(found) < Version(TORCHAO_MIN_VERSION):
        raise ImportError(
            f"optim={args.optim!r} needs torchao>={TORCHAO_MIN_VERSION}, found {found}: pip install -U torchao"
        )
    torchao_optim = _import_torchao_optim()
    return getattr(torchao_optim, TORCHAO_ADAMW[args.optim])(
        groups,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        block_size=options.get("block_size", 256),
        bf16_stochastic_round=options.get("bf16_stochastic_round", False),
    )


def _import_torchao_optim():
    """``torchao.optim``. Without CUDA, torchao's import logs a warning for each of its CUDA kernel libraries that
    cannot load (they serve only its GPU quantization paths, never these optimizers): silenced on such a machine."""
    logger = logging.getLogger("torchao")
    level = logger.level
    if not torch.cuda.is_available():
        logger.setLevel(logging.ERROR)
    try:
        import torchao.optim
    finally:
        logger.setLevel(level)
    return torchao.optim


def build_optimizer(model: torch.nn.Module, args) -> torch.optim.Optimizer:
    """The optimizer ``args.optim`` names, over ``param_groups`` (as transformers builds it):

    - ``adamw`` / ``adamw_torch``: ``torch.optim.AdamW``; ``adamw_torch_fused``: the same with ``fused=True``
    - ``sgd``: ``torch.optim.SGD`` without momentum; ``optim_args="momentum=0.9,nesterov=True"`` adds it
    - ``adafactor``: transformers' ``Adafactor`` with the given learning rate (no relative step or scaling)
    - ``adamw_8bit`` (alias ``adamw_bnb_8bit``) / ``paged_adamw_8bit``: bitsandbytes' 8-bit AdamW (CUDA)
    - ``adamw_torch_8bit`` / ``adamw_torch_4bit``: torchao's ``AdamW8bit`` / ``AdamW4bit`` (CPU and GPU): the moments
      in 8 or 4 bits, a quarter or an eighth of AdamW's state (``_torchao_adamw``)

    float16 weights with torch's AdamW and an epsilon that is 0 in float16 are refused (:func:`check_float16_adamw`).
    """
    groups = param_groups(model, args.weight_decay)
    if not groups:
        raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
    options = optimizer_options(args.optim, getattr(args, "optim_args", None))
    if args.optim == "sgd":  # no momentum unless optim_args says (transformers' sgd)
        return torch.optim.SGD(groups, lr=args.learning_rate, **options)
    if args.optim == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(groups, lr=args.learning_rate, scale_parameter=False, relative_step=False)
    if args.optim in ("adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit"):
        return _bitsandbytes_adamw(groups, args, paged=args.optim.startswith("paged_"))
    if args.optim in TORCHAO_ADAMW:
        return _torchao_adamw(groups, args, options)
    if any(p.dtype == torch.float16 for group in groups for p in group["params"]):
        check_float16_adamw(args, f"{type(model).__name__}'s float16 weights")
    fused = args.optim == "adamw_torch_fused"
    return torch.optim.AdamW(
        groups,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        fused=fused or None,
    )


# ---- schedules: transformers' own -----------------------------------------------------------------------------
WSD_SHAPES = ("linear", "cosine", "1-sqrt")  # warmup_stable_decay's warmup_type and decay_type

SCHEDULE_OPTIONS = {  # lr_scheduler_kwargs each schedule takes (transformers' names)
    "constant": (),
    "constant_with_warmup": (),
    "linear": (),
    "cosine": ("num_cycles",),
    "cosine_with_restarts": ("num_cycles",),
    "polynomial": ("lr_end", "power"),
    "inverse_sqrt": ("timescale",),
    "cosine_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate"),
    "cosine_warmup_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate", "warmup_lr_rate"),
    "warmup_stable_decay": (
        "num_decay_steps",
        "num_stable_steps",
        "warmup_type",
        "decay_type",
        "min_lr_ratio",
        "num_cycles",
    ),
}


def build_scheduler(
    name: str,
    optimizer: torch.optim.Optimizer,
    *,
    num_warmup_steps: int,
    num_training_steps: int,
    scheduler_kwargs: dict | None = None,
) -> LambdaLR:
    """The schedule ``name``, built by ``transformers.get_scheduler`` itself (a ``LambdaLR``, its state just
    ``last_epoch``): warm-up from 0 to the peak over ``num_warmup_steps`` (except ``cosine_warmup_with_min_lr``),
    then the named decay over ``num_training_steps``. ``scheduler_kwargs`` is ``lr_scheduler_kwargs``, checked
    first (``SCHEDULE_OPTIONS``) so that an option the schedule does not read is an error, never ignored."""
    from transformers.optimization import get_scheduler  # heavy (transformers): loaded when training starts

    check_scheduler_kwargs(name, scheduler_kwargs)
    kwargs = dict(scheduler_kwargs or {})
    if name == "polynomial" and not optimizer.defaults["lr"] > kwargs.get("lr_end", 1e-7):
        raise ValueError(
            f"polynomial schedule: lr_end ({kwargs.get('lr_end', 1e-7)}) must be below the "
            f"learning rate ({optimizer.defaults['lr']})"
        )
    for shape in ("warmup_type", "decay_type"):
        if name == "warmup_stable_decay" and kwargs.get(shape, "linear") not in WSD_SHAPES:
            raise ValueError(f"{shape}={kwargs[shape]!r} is not supported; use one of {list(WSD_SHAPES)}")
    return get_scheduler(
        name,
        optimizer,
        num_warmup_steps=num_warmup_steps,
        num_training_steps=num_training_steps,
        scheduler_specific_kwargs=kwargs,
    )


def check_scheduler_kwargs(name: str, scheduler_kwargs: dict | None) -> None:
    """ValueError unless ``name`` is a schedule treadle builds and ``scheduler_kwargs`` are options it reads, with
    those it needs (``TrainingArguments`` checks this when built; the values are checked when the schedule is)."""
    if name in _SCHEDULER_POINTERS:
        raise ValueError(f"lr_scheduler_type={name!r} is not built in: {_SCHEDULER_POINTERS[name]}")
    if name not in SCHEDULE_OPTIONS:
        raise ValueError(f"lr_scheduler_type={name!r} is not supported; use one of {list(SCHEDULE_OPTIONS)}")
    given = set(scheduler_kwargs or {})
    unknown = sorted(given - set(SCHEDULE_OPTIONS[name]))
    if unknown:
        raise ValueError(
            f"lr_scheduler_kwargs {unknown} are not read by lr_scheduler_type={name!r}; it takes "
            f"{list(SCHEDULE_OPTIONS[name]) or 'none'}"
        )
    if name.endswith("with_min_lr") and len(given & {"min_lr", "min_lr_rate"}) != 1:
        raise ValueError(
            f"lr_scheduler_type={name!r} needs exactly one of min_lr or min_lr_rate in "
            f"lr_scheduler_kwargs, e.g. lr_scheduler_kwargs={{'min_lr_rate': 0.1}}"
        )
    if name == "warmup_stable_decay" and "num_decay_steps" not in given:
        raise ValueError(
            "lr_scheduler_type='warmup_stable_decay' needs lr_scheduler_kwargs={'num_decay_steps': N} "
            "(optionally num_stable_steps, warmup_type, decay_type, min_lr_ratio, num_cycles)"
        )
