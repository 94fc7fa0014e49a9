"""Optimizer grouping and the learning-rate schedules against hand-computed values."""

import math

import pytest
import torch

from treadle import TrainingArguments
from treadle.optim import build_optimizer, build_scheduler


def lrs(name, warmup, total, steps=None, **kwargs):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total, scheduler_kwargs=kwargs)
    out = []
    for _ in range(steps or total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_constant():
    assert lrs("constant", 0, 4) == [1.0] * 4


def test_constant_with_warmup_starts_at_zero_as_transformers():
    # warm-up s / w for s < w (the first update has lr 0, the peak is reached at s = w), as transformers
    assert lrs("constant_with_warmup", 3, 6) == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0, 1.0, 1.0])


def test_linear_warmup_then_decay_to_zero():
    # warm-up s/w for s < w, then (total - s) / (total - w)
    assert lrs("linear", 2, 6, steps=7) == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0])


def test_cosine_with_min_lr_and_restarts():
    # min_lr_rate m: m + (1 - m) * half-cosine; restarts: num_cycles cosines over the run, 0 at the end
    half = [0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(5)]
    assert lrs("cosine_with_min_lr", 0, 4, steps=5, min_lr_rate=0.1) == pytest.approx([0.1 + 0.9 * h for h in half])
    assert lrs("cosine_with_restarts", 0, 4, steps=5, num_cycles=2) == pytest.approx([1.0, 0.5, 1.0, 0.5, 0.0])


def test_warmup_stable_decay_and_inverse_sqrt():
    # wsd: 2 warm-up steps (0, 0.5), stable at 1 until the decay's 2 steps (linear: 1, 0.5), then min_lr_ratio 0
    assert lrs("warmup_stable_decay", 2, 6, steps=7, num_decay_steps=2, decay_type="linear") == pytest.approx(
        [0.0, 0.5, 1.0, 1.0, 1.0, 0.5, 0.0]
    )
    # inverse_sqrt after warm-up w: 1 / sqrt(s / w) (timescale = w)
    assert lrs("inverse_sqrt", 4, 10, steps=9)[4:] == pytest.approx(
        [1.0, (4 / 5) ** 0.5, (4 / 6) ** 0.5, (4 / 7) ** 0.5, (4 / 8) ** 0.5]
    )


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("cosine_with_min_lr", {}, "exactly one of min_lr or min_lr_rate"),
        ("warmup_stable_decay", {}, "num_decay_steps"),
        ("linear", {"num_cycles": 2}, r"\['num_cycles'\] are not read by lr_scheduler_type='linear'"),
        ("reduce_lr_on_plateau", {}, "ReduceLROnPlateau"),
    ],
)
def test_schedule_options_are_checked_when_the_arguments_are_built(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainingArguments(lr_scheduler_type=name, lr_scheduler_kwargs=kwargs)


def test_cosine():
    expected = [0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(5)]
    assert lrs("cosine", 0, 4, steps=5) == pytest.approx(expected)


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    opt = build_optimizer(model, TrainingArguments(weight_decay=0.1))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.1 for p in g["params"]}
    assert decayed == {id(model[0].weight)}
    assert sum(len(g["params"]) for g in opt.param_groups) == 4


def test_sgd_has_no_momentum_unless_optim_args_says():
    model = torch.nn.Linear(2, 2)
    plain = build_optimizer(model, TrainingArguments(optim="sgd"))
    assert isinstance(plain, torch.optim.SGD) and plain.defaults["momentum"] == 0
    heavy = build_optimizer(model, TrainingArguments(optim="sgd", optim_args="momentum=0.9, nesterov=True"))
    assert heavy.defaults["momentum"] == 0.9 and heavy.defaults["nesterov"] is True
    with pytest.raises(ValueError, match="optim='sgd' / 'adamw_torch_8bit' / 'adamw_torch_4bit' only"):
        TrainingArguments(optim="adamw", optim_args="momentum=0.9")
    with pytest.raises(ValueError, match="'betas' is not a setting of optim='sgd'; use momentum, dampening"):
        TrainingArguments(optim="sgd", optim_args="betas=0.9")


def test_adafactor_and_a_clear_error_for_8bit_without_bitsandbytes():
    import importlib.util

    from transformers.optimization import Adafactor

    model = torch.nn.Linear(2, 2)
    assert isinstance(build_optimizer(model, TrainingArguments(optim="adafactor")), Adafactor)
    if importlib.util.find_spec("bitsandbytes") is None:
        with pytest.raises(ImportError, match="pip install bitsandbytes"):
            build_optimizer(model, TrainingArguments(optim="paged_adamw_8bit"))


def test_frozen_models():
    model = torch.nn.Linear(2, 2)
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(model, TrainingArguments())
