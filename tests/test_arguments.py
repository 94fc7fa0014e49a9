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


@pytest.mark.parametrize(
    "kwargs, message",
    [
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
        (
            dict(load_best_model_at_end=True, eval_strategy="steps", save_strategy="epoch"),
            "save_strategy == eval_strategy",
        ),
        (
            dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=10, save_steps=25),
            "multiple of eval_steps.*save_steps=20",
        ),
        (dict(fsdp="hybrid"), "fsdp='hybrid'"),
    ],
)
def test_invalid_combinations_say_how_to_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainingArguments(**kwargs)


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("learning_rate", 1e300, r"learning_rate must lie in \[0, 10\]"),
        ("seed", -1, r"seed and data_seed must lie in \[0, 2\*\*32 - 1\]"),
        ("dataloader_num_workers", -1, "dataloader_num_workers must be >= 0"),
    ],
)
def test_out_of_range_values_are_refused_at_config_time(field, value, needle):
    from treadle import TrainingArguments

    with pytest.raises(ValueError, match=needle):
        TrainingArguments(**{field: value})


def test_round_trip_through_json():
    import json

    args = TrainingArguments(
        learning_rate=3e-4,
        lr_scheduler_type=SCHEDULERS[-1],
        lr_scheduler_kwargs={"num_decay_steps": 3},
        optim="sgd",
        optim_args="momentum=0.9",
    )
    again = TrainingArguments(**json.loads(args.to_json_string()))
    assert again == args


# ---- from_mapping: a config from a YAML mapping ---------------------------------------------------------------
def test_from_mapping_refuses_an_unknown_key_naming_the_closest():
    with pytest.raises(
        ValueError,
        match=r"unknown key 'lerning_rate' for TrainingArguments; did you mean "
        r"'learning_rate'\?",
    ):
        TrainingArguments.from_mapping({"lerning_rate": 0.1})
    with pytest.raises(ValueError, match=r"unknown key 'modle' for trainer sft; did you mean 'model'\?"):
        TrainingArguments.from_mapping({"modle": "toy:tiny"}, other_keys=("model",), context="trainer sft")
    with pytest.raises(ValueError, match="unknown key 'zzzzzz' for TrainingArguments; see the fields of"):
        TrainingArguments.from_mapping({"zzzzzz": 1})


def test_from_mapping_turns_yaml_numbers_into_floats():
    args = TrainingArguments.from_mapping(
        {"learning_rate": "1e-3", "warmup_steps": 2, "max_grad_norm": 1, "ddp_timeout": 60}
    )
    assert (args.learning_rate, args.warmup_steps, args.max_grad_norm, args.ddp_timeout) == (0.001, 2.0, 1.0, 60.0)
    assert all(type(v) is float for v in (args.learning_rate, args.warmup_steps, args.max_grad_norm, args.ddp_timeout))
    assert type(TrainingArguments.from_mapping({"max_steps": 5}).max_steps) is int  # ints stay ints


@pytest.mark.parametrize(
    "mapping, message",
    [
        ({"max_steps": "ten"}, "max_steps must be an integer, got 'ten'"),
        ({"max_steps": 2.5}, "max_steps must be an integer, got 2.5"),
        ({"max_steps": True}, "max_steps must be an integer, got True"),
        ({"bf16": "maybe"}, "bf16 must be true or false, got 'maybe'"),
        ({"learning_rate": "fast"}, "learning_rate must be a number, got 'fast'"),
        ({"learning_rate": True}, "learning_rate must be a number, got True"),
        ({"learning_rate": None}, "learning_rate must be a number, got None"),
        ({"save_total_limit": "x"}, r"save_total_limit must be an integer \(or null\), got 'x'"),
        ({"run_name": 7}, r"run_name must be a string \(or null\), got 7"),
        ({"report_to": 5}, "report_to must be a string or a list of strings, got 5"),
        ({"label_names": "labels"}, r"label_names must be a list of strings \(or null\), got 'labels'"),
        ({"label_names": ["labels", 3]}, r"label_names must be a list of strings \(or null\), got \['labels', 3\]"),
    ],
)
def test_from_mapping_refuses_a_wrong_type_naming_the_key(mapping, message):
    with pytest.raises(ValueError, match=message):
        TrainingArguments.from_mapping(mapping)


def test_from_mapping_takes_none_where_the_annotation_allows_it():
    args = TrainingArguments.from_mapping({"save_total_limit": None, "eval_steps": None, "logging_steps": 4})
    assert args.save_total_limit is None and args.eval_steps == 4  # None reached __post_init__: "logging_steps"
    assert TrainingArguments.from_mapping({"save_total_limit": 3}).save_total_limit == 3


def test_from_mapping_list_fields():
    args = TrainingArguments.from_mapping({"label_names": ["labels", "mask"], "report_to": ["tensorboard"]})
    assert args.label_names == ["labels", "mask"] and args.report_to == ["tensorboard"]
    assert TrainingArguments.from_mapping({"report_to": "none"}).report_to == []  # the str member of the union
    from treadle.trainers.grpo.trainer import GRPOConfig

    weights = GRPOConfig.from_mapping({"reward_weights": [1, 0.5]}).reward_weights
    assert weights == [1.0, 0.5] and all(type(w) is float for w in weights)  # list[float]: items converted too


def test_from_mapping_of_a_subclass_sees_its_own_fields():
    from treadle.trainers.sft import SFTConfig

    args = SFTConfig.from_mapping({"packing": True, "max_length": 64, "learning_rate": 1})
    assert type(args) is SFTConfig and args.packing is True and args.max_length == 64 and args.learning_rate == 1.0
    assert SFTConfig.from_mapping({"max_length": None}).max_length is None  # int | None, declared in sft.py
    with pytest.raises(ValueError, match=r"did you mean 'packing'\?"):
        SFTConfig.from_mapping({"pakcing": True})
    with pytest.raises(ValueError, match="unknown key 'packing' for TrainingArguments"):
        TrainingArguments.from_mapping({"packing": True})


def test_from_mapping_keeps_the_validation_of_post_init():
    from treadle.trainers.sft import SFTConfig

    with pytest.raises(ValueError, match="packing=True needs max_length"):
        SFTConfig.from_mapping({"packing": True, "max_length": None})


def test_from_mapping_takes_back_every_config_it_wrote():
    # every default (after __post_init__) fits its own annotation, in every config class
    from treadle.trainers.dpo import DPOConfig
    from treadle.trainers.grpo.trainer import GRPOConfig
    from treadle.trainers.sft import SFTConfig

    for cls in (TrainingArguments, SFTConfig, DPOConfig, GRPOConfig):
        assert cls.from_mapping(cls().to_dict()) == cls(), cls.__name__


def test_each_log_prob_option_is_declared_once_and_mixed_into_the_configs_that_take_it():
    from treadle.arguments import LogprobChunkOption, PaddingFreeOption, SharedPrefixOption
    from treadle.trainers.distillation import DistillationConfig
    from treadle.trainers.dpo import DPOConfig
    from treadle.trainers.grpo.config import GRPOConfig
    from treadle.trainers.kto import KTOConfig

    options = {
        PaddingFreeOption: ("padding_free", True),
        SharedPrefixOption: ("shared_prefix", True),
        LogprobChunkOption: ("logprob_chunk_size", None),  # None: rows from the vocabulary (logprobs.chunk_rows)
    }  # TRL's names and treadle's defaults
    takes = {
        DPOConfig: set(options),
        KTOConfig: {PaddingFreeOption, LogprobChunkOption},
        GRPOConfig: {PaddingFreeOption, SharedPrefixOption},
        DistillationConfig: {LogprobChunkOption},
    }
    for option, (name, default) in options.items():
        line = next(line for line in inspect.getsource(option).splitlines() if line.strip().startswith(f"{name}:"))
        assert "#" in line, f"{name} has no one-line comment"
        for config, taken in takes.items():
            assert (name in config.field_names()) == (option in taken), (config.__name__, name)
            assert name not in vars(config).get("__annotations__", {}), f"{config.__name__} declares {name} again"
            if option in taken:
                assert getattr(config(), name) == default, (config.__name__, name)
    for config in (DPOConfig, KTOConfig, DistillationConfig):  # the option checks its value, after the base's checks
        with pytest.raises(ValueError, match="logprob_chunk_size must be >= 1"):
            config(logprob_chunk_size=0)
