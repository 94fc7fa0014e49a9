"""Optimizer and learning-rate schedule builders (plain torch; the schedules are picklable-free functions of
the step so that their state is just ``last_epoch``)."""

from __future__ import annotations

import functools
import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices decay, vectors (biases, norm weights) and scalars don't — as in nanoGPT and GPT-2."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: torch.nn.Module, args) -> torch.optim.Optimizer:
    groups = param_groups(model, args.weight_decay)
    if not groups:
        raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
    if args.optim == "sgd":
        return torch.optim.SGD(groups, lr=args.learning_rate, momentum=args.adam_beta1)
    fused = args.optim == "adamw_torch_fused"
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon, fused=fused or None)


def _constant(step: int) -> float:
    return 1.0


def _constant_with_warmup(step: int, *, warmup: int) -> float:
    return min(1.0, (step + 1) / (warmup + 1)) if warmup else 1.0


def _linear(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / (warmup + 1)
    return max(0.0, (total - step) / max(1, total - warmup))


def _cosine(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def build_scheduler(name: str, optimizer: torch.optim.Optimizer, *, num_warmup_steps: int,
                    num_training_steps: int) -> LambdaLR:
    """Multiplier of the peak learning rate at each optimizer step (step 0 is the first update).

    Warm-up ramps linearly to 1 over ``num_warmup_steps`` (never 0 at the first step: a zero-lr step is a
    wasted step); ``linear`` then decays to 0 at ``num_training_steps``; ``cosine`` follows half a cosine.
    """
    if name == "constant":
        fn = _constant
    elif name == "constant_with_warmup":
        fn = functools.partial(_constant_with_warmup, warmup=num_warmup_steps)
    elif name == "linear":
        fn = functools.partial(_linear, warmup=num_warmup_steps, total=num_training_steps)
    elif name == "cosine":
        fn = functools.partial(_cosine, warmup=num_warmup_steps, total=num_training_steps)
    else:
        raise ValueError(f"unknown lr_scheduler_type {name!r}")
    return LambdaLR(optimizer, fn)
