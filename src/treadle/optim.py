"""Optimizer and learning-rate schedule builders: transformers' names mean transformers' behaviour.

Every ``optim`` and ``lr_scheduler_type`` name that treadle shares with ``transformers.TrainingArguments`` builds
the same optimizer and the same multiplier of the peak learning rate at every step (tests/test_parity_transformers.py
checks each against transformers itself). A schedule is a ``LambdaLR`` over a picklable ``functools.partial``, so
its state is just ``last_epoch``. Step ``s`` counts optimizer steps already taken: the first update uses ``s = 0``,
which is why a warm-up starts at 0 (as in transformers) and reaches the peak at ``s = warmup``.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math

import torch
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


def optimizer_options(optim: str, optim_args: str | None) -> dict:
    """The keyword arguments ``optim_args`` gives the optimizer ``optim``: SGD's ``momentum``, ``dampening``,
    ``weight_decay`` and ``nesterov`` (transformers' ``sgd`` reads those); other optimizers take none.

    >>> optimizer_options("sgd", "momentum=0.9,nesterov=True")
    {'momentum': 0.9, 'nesterov': True}
    """
    options = parse_optim_args(optim_args)
    if options and optim != "sgd":
        raise ValueError(f"optim_args is read by optim='sgd' only (momentum, dampening, weight_decay, nesterov); "
                         f"optim={optim!r} takes its settings from adam_beta1, adam_beta2, adam_epsilon")
    kwargs: dict = {}
    for key, value in options.items():
        if key in ("momentum", "dampening", "weight_decay"):
            kwargs[key] = float(value)
        elif key == "nesterov":
            kwargs[key] = value.lower() in ("true", "1", "yes")
        else:
            raise ValueError(f"optim_args key {key!r} is not an SGD setting; use momentum, dampening, weight_decay "
                             f"or nesterov")
    return kwargs


def _bitsandbytes_adamw(groups: list[dict], args, paged: bool) -> torch.optim.Optimizer:
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError(f"optim={args.optim!r} needs bitsandbytes (8-bit optimizer states, CUDA): "
                          f"pip install bitsandbytes; or use optim='adamw_torch'")
    from bitsandbytes.optim import AdamW

    return AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                 optim_bits=8, is_paged=paged)


def build_optimizer(model: torch.nn.Module, args) -> torch.optim.Optimizer:
    """The optimizer ``args.optim`` names, over ``param_groups`` (as transformers builds it):

    - ``adamw`` / ``adamw_torch``: ``torch.optim.AdamW``; ``adamw_torch_fused``: the same with ``fused=True``
    - ``sgd``: ``torch.optim.SGD`` without momentum; ``optim_args="momentum=0.9,nesterov=True"`` adds it
    - ``adafactor``: transformers' ``Adafactor`` with the given learning rate (no relative step or scaling)
    - ``adamw_8bit`` (alias ``adamw_bnb_8bit``) / ``paged_adamw_8bit``: bitsandbytes' 8-bit AdamW
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
    fused = args.optim == "adamw_torch_fused"
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon, fused=fused or None)


# ---- schedules: multipliers of the peak learning rate at optimizer step s (transformers' formulas) --------------
def _warmup(step: int, warmup: int) -> float:
    return step / max(1, warmup)


def _constant(step: int) -> float:
    return 1.0


def _constant_with_warmup(step: int, *, warmup: int) -> float:
    return _warmup(step, warmup) if step < warmup else 1.0


def _linear(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def _cosine(step: int, *, warmup: int, total: int, num_cycles: float = 0.5, min_lr_rate: float = 0.0) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0.0, factor * (1.0 - min_lr_rate) + min_lr_rate)


def _cosine_with_restarts(step: int, *, warmup: int, total: int, num_cycles: int = 1) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((num_cycles * progress) % 1.0))))


def _polynomial(step: int, *, warmup: int, total: int, lr_init: float, lr_end: float = 1e-7,
                power: float = 1.0) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    if step > total:
        return lr_end / lr_init
    remaining = 1 - (step - warmup) / max(1, total - warmup)
    return ((lr_init - lr_end) * remaining ** power + lr_end) / lr_init


def _inverse_sqrt(step: int, *, warmup: int, timescale: int | None = None) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    timescale = timescale or warmup or 10_000
    return 1.0 / math.sqrt((step + timescale - warmup) / timescale)


def _cosine_warmup_with_min_lr(step: int, *, warmup: int, total: int, min_lr_rate: float, num_cycles: float = 0.5,
                               warmup_lr_rate: float | None = None) -> float:
    # transformers' "cosine_warmup_with_min_lr": the warm-up never starts at 0, the decay is shifted by one step
    if step < warmup:
        if warmup_lr_rate is None:
            return (step + 1.0) / max(1.0, warmup)
        return warmup_lr_rate + (1.0 - warmup_lr_rate) * step / max(1, warmup - 1)
    progress = (step - warmup + 1.0) / max(1.0, total - warmup)
    factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0.0, factor * (1.0 - min_lr_rate) + min_lr_rate)


WSD_SHAPES = ("linear", "cosine", "1-sqrt")  # warmup_stable_decay's warmup_type and decay_type


def _warmup_stable_decay(step: int, *, warmup: int, stable: int, decay: int, warmup_type: str, decay_type: str,
                         min_lr_ratio: float, num_cycles: float) -> float:
    if step < warmup:
        progress = step / max(1, warmup)
        factor = {"linear": progress, "cosine": 0.5 * (1.0 - math.cos(math.pi * progress)),
                  "1-sqrt": 1.0 - math.sqrt(1.0 - progress)}[warmup_type]
    elif step < warmup + stable:
        return 1.0
    elif step < warmup + stable + decay:
        progress = (step - warmup - stable) / max(1, decay)
        factor = {"linear": 1.0 - progress, "cosine": 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress)),
                  "1-sqrt": 1.0 - math.sqrt(progress)}[decay_type]
    else:
        return min_lr_ratio
    return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)


def _wsd_options(warmup: int, total: int, num_decay_steps: int, num_stable_steps: int | None = None,
                 warmup_type: str = "linear", decay_type: str = "cosine", min_lr_ratio: float = 0.0,
                 num_cycles: float = 0.5) -> dict:
    for name, value in (("warmup_type", warmup_type), ("decay_type", decay_type)):
        if value not in WSD_SHAPES:
            raise ValueError(f"{name}={value!r} is not supported; use one of {list(WSD_SHAPES)}")
    stable = num_stable_steps if num_stable_steps is not None else total - warmup - num_decay_steps
    return dict(warmup=warmup, stable=stable, decay=num_decay_steps, warmup_type=warmup_type,
                decay_type=decay_type, min_lr_ratio=min_lr_ratio, num_cycles=num_cycles)


def _schedule(name: str, warmup: int, total: int, lr_init: float, kwargs: dict):
    """The multiplier function ``name`` describes, with ``kwargs`` (``lr_scheduler_kwargs``) bound."""
    if name == "constant":
        return functools.partial(_constant)
    if name == "constant_with_warmup":
        return functools.partial(_constant_with_warmup, warmup=warmup)
    if name == "inverse_sqrt":
        return functools.partial(_inverse_sqrt, warmup=warmup, **kwargs)
    if name == "warmup_stable_decay":
        return functools.partial(_warmup_stable_decay, **_wsd_options(warmup, total, **kwargs))
    if name == "polynomial":
        if not lr_init > kwargs.get("lr_end", 1e-7):
            raise ValueError(f"polynomial schedule: lr_end ({kwargs.get('lr_end', 1e-7)}) must be below the "
                             f"learning rate ({lr_init})")
        return functools.partial(_polynomial, warmup=warmup, total=total, lr_init=lr_init, **kwargs)
    if name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        min_lr, rate = kwargs.pop("min_lr", None), kwargs.pop("min_lr_rate", None)  # exactly one (checked)
        rate = min_lr / lr_init if min_lr is not None else rate
        fn = _cosine if name == "cosine_with_min_lr" else _cosine_warmup_with_min_lr
        return functools.partial(fn, warmup=warmup, total=total, min_lr_rate=rate, **kwargs)
    fn = {"linear": _linear, "cosine": _cosine, "cosine_with_restarts": _cosine_with_restarts}[name]
    return functools.partial(fn, warmup=warmup, total=total, **kwargs)


SCHEDULE_OPTIONS = {  # lr_scheduler_kwargs each schedule takes (transformers' names)
    "constant": (), "constant_with_warmup": (), "linear": (), "cosine": ("num_cycles",),
    "cosine_with_restarts": ("num_cycles",), "polynomial": ("lr_end", "power"), "inverse_sqrt": ("timescale",),
    "cosine_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate"),
    "cosine_warmup_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate", "warmup_lr_rate"),
    "warmup_stable_decay": tuple(inspect.signature(_wsd_options).parameters)[2:],
}


def build_scheduler(name: str, optimizer: torch.optim.Optimizer, *, num_warmup_steps: int,
                    num_training_steps: int, scheduler_kwargs: dict | None = None) -> LambdaLR:
    """The schedule ``name`` (transformers' ``get_scheduler``): warm-up from 0 to the peak over ``num_warmup_steps``
    (except ``cosine_warmup_with_min_lr``, as in transformers), then the named decay over ``num_training_steps``.
    ``scheduler_kwargs`` is ``lr_scheduler_kwargs`` (see ``SCHEDULE_OPTIONS``)."""
    check_scheduler_kwargs(name, scheduler_kwargs)
    fn = _schedule(name, num_warmup_steps, num_training_steps, optimizer.defaults["lr"], dict(scheduler_kwargs or {}))
    return LambdaLR(optimizer, fn)


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
        raise ValueError(f"lr_scheduler_kwargs {unknown} are not read by lr_scheduler_type={name!r}; it takes "
                         f"{list(SCHEDULE_OPTIONS[name]) or 'none'}")
    if name.endswith("with_min_lr") and len(given & {"min_lr", "min_lr_rate"}) != 1:
        raise ValueError(f"lr_scheduler_type={name!r} needs exactly one of min_lr or min_lr_rate in "
                         f"lr_scheduler_kwargs, e.g. lr_scheduler_kwargs={{'min_lr_rate': 0.1}}")
    if name == "warmup_stable_decay" and "num_decay_steps" not in given:
        raise ValueError("lr_scheduler_type='warmup_stable_decay' needs lr_scheduler_kwargs={'num_decay_steps': N} "
                         "(optionally num_stable_steps, warmup_type, decay_type, min_lr_ratio, num_cycles)")
