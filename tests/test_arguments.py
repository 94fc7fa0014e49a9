"""TrainingArguments: defaults, derived values and the validation messages."""

import dataclasses
import inspect

import pytest

from treadle import TrainingArguments
from treadle.arguments import SCHEDULERS


def test_every_field_has_a_default_and_a_comment():
    source = inspect.getsource(TrainingArguments)
    for f in dataclasses.fields(TrainingArguments):
        assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, f.name
        line = next(line for line in source.splitlines() if line.strip().startswith(f"{f.name}:"))
        assert "#" in line, f"{f.name} has no one-line comment"


def test_the_issue_fields_exist():
    names = TrainingArguments.field_names()
    wanted = """output_dir num_train_epochs max_steps per_device_train_batch_size per_device_eval_batch_size
    gradient_accumulation_steps learning_rate weight_decay adam_beta1 adam_beta2 adam_epsilon optim
    lr_scheduler_type warmup_steps max_grad_norm logging_steps logging_first_step eval_strategy eval_steps
    save_strategy save_steps save_total_limit load_best_model_at_end metric_for_best_model greater_is_better seed
    data_seed bf16 gradient_checkpointing remove_unused_columns dataloader_num_workers dataloader_drop_last
    report_to disable_tqdm label_names""".split()
    assert set(wanted) <= names


def test_derived_defaults():
    args = TrainingArguments(logging_steps=7, seed=3)
    assert args.eval_steps == 7 and args.data_seed == 3 and args.label_names == ["labels"] and args.report_to == []
    assert TrainingArguments(report_to="tensorboard").report_to == ["tensorboard"]
    best = TrainingArguments(eval_strategy="steps", save_steps=20, eval_steps=10, load_best_model_at_end=True)
    assert best.metric_for_best_model == "loss" and best.greater_is_better is False
    assert TrainingArguments(metric_for_best_model="accuracy").greater_is_better is True


@pytest.mark.parametrize("warmup, total, expected", [(0, 100, 0), (10, 100, 10), (0.1, 100, 10), (0.05, 30, 2)])
def test_warmup_steps_int_or_ratio(warmup, total, expected):
    assert TrainingArguments(warmup_steps=warmup).num_warmup_steps(total) == expected


@pytest.mark.parametrize("kwargs, message", [
    (dict(optim="adam8bit"), r"optim='adam8bit' is not supported; use one of \['adamw'"),
    (dict(lr_scheduler_type="poly"), "lr_scheduler_type='poly'"),
    (dict(eval_strategy="sometimes"), "eval_strategy='sometimes'"),
    (dict(per_device_train_batch_size=0), "per_device_train_batch_size must be an integer >= 1"),
    (dict(gradient_accumulation_steps=1.5), "gradient_accumulation_steps must be an integer"),
    (dict(max_steps=-1, num_train_epochs=0), "set max_steps > 0 or num_train_epochs > 0"),
    (dict(warmup_steps=2.5), "warmup_steps must be a whole number"),
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(max_grad_norm=-1.0), "max_grad_norm"),
    (dict(save_total_limit=0), "save_total_limit"),
    (dict(load_best_model_at_end=True), "needs evaluations: set eval_strategy"),
    (dict(load_best_model_at_end=True, eval_strategy="steps", save_strategy="epoch"), "save_strategy == eval_strategy"),
    (dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=10, save_steps=25),
     "multiple of eval_steps.*save_steps=20"),
    (dict(fsdp="hybrid"), "fsdp='hybrid'"),
])
def test_invalid_combinations_say_how_to_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainingArguments(**kwargs)


def test_round_trip_through_json():
    import json

    args = TrainingArguments(learning_rate=3e-4, lr_scheduler_type=SCHEDULERS[-1])
    again = TrainingArguments(**json.loads(args.to_json_string()))
    assert again == args
