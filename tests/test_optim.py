"""Optimizer grouping and the learning-rate schedules against hand-computed values."""

import math

import pytest
import torch

from treadle import TrainingArguments
from treadle.optim import build_optimizer, build_scheduler


def lrs(name, warmup, total, steps=None):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total)
    out = []
    for _ in range(steps or total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_constant():
    assert lrs("constant", 0, 4) == [1.0] * 4


def test_constant_with_warmup():
    assert lrs("constant_with_warmup", 3, 6) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_linear_warmup_then_decay_to_zero():
    # warm-up (s+1)/(w+1) for s < w, then (total - s) / (total - w)
    assert lrs("linear", 1, 5, steps=6) == pytest.approx([0.5, 1.0, 0.75, 0.5, 0.25, 0.0])


def test_cosine():
    expected = [0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(5)]
    assert lrs("cosine", 0, 4, steps=5) == pytest.approx(expected)


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    opt = build_optimizer(model, TrainingArguments(weight_decay=0.1))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.1 for p in g["params"]}
    assert decayed == {id(model[0].weight)}
    assert sum(len(g["params"]) for g in opt.param_groups) == 4


def test_sgd_and_frozen_models():
    model = torch.nn.Linear(2, 2)
    assert isinstance(build_optimizer(model, TrainingArguments(optim="sgd")), torch.optim.SGD)
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(model, TrainingArguments())
